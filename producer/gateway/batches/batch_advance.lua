-- KEYS[1] = the batch hash
-- ARGV[1] = the new next_line
-- Moves the batch's next_line cursor forward, never back (two runners overlapping after a
-- lease lapse cannot move it back). Returns {"ok", next_line after the call}.
local now = tonumber(redis.call('HGET', KEYS[1], 'next_line') or '0')
local asked = tonumber(ARGV[1])
if asked > now then
  redis.call('HSET', KEYS[1], 'next_line', asked)
  now = asked
end
return {'ok', now}
