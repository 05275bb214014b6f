-- KEYS[1] = the batch hash
-- ARGV[1] = now (epoch seconds, whole)
-- Asks for a batch's cancellation: a validating or in_progress batch becomes cancelling (its
-- runner cancels what runs and finalizes it cancelled). Returns {"ok", status after the call}
-- or {"unknown", message} when there is no such batch.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return {'unknown', 'no such batch'}
end
if status == 'validating' or status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
  status = 'cancelling'
end
return {'ok', status}
