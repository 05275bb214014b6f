-- KEYS[1] = names of live API keys (Keys.api_key_names): HGET ARGV[2]; HSET ARGV[2] ARGV[1]
-- KEYS[2] = set of API key ids (Keys.api_keys): SISMEMBER, SADD ARGV[1]
-- KEYS[3] = the new key's hash (Keys.api_key): EXISTS; HSET the record
-- ARGV[1] = key id   ARGV[2] = name   ARGV[3..] = the record's field, value pairs
-- Creates the key unless a live key has the name (names are unique among live keys) or the id
-- is taken.
-- Returns {"ok"}; {"taken"}: the id exists (the caller draws another one);
--         {"invalid", message}: a live key already has this name.
local other = redis.call('HGET', KEYS[1], ARGV[2])
if other then
  return {'invalid', 'an API key named ' .. ARGV[2] .. ' already exists (id ' .. other ..
    '); revoke it first or choose another name'}
end
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then
  return {'taken'}
end
redis.call('HSET', KEYS[3], unpack(ARGV, 3))
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[2], ARGV[1])
return {'ok'}
