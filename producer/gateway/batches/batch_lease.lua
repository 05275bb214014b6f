-- KEYS[1] = the batch's lease key
-- ARGV[1] = this runner's token           ARGV[2] = new lifetime in ms, or "0" to release
-- Renews (or releases) the lease only while this runner holds it. Returns {"ok"} when it
-- did, {"lost"} when another runner holds it or it lapsed.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {'lost'}
end
if ARGV[2] == '0' then
  redis.call('DEL', KEYS[1])
else
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return {'ok'}
