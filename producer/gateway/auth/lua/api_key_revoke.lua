-- KEYS[1] = names of live API keys (Keys.api_key_names): HGET, HDEL the key's name
-- KEYS[2] = the key's hash (Keys.api_key): HMGET name revoked_at; HSET revoked_at;
--           HDEL digest rq tk ts
-- ARGV[1] = key id   ARGV[2] = revoked_at (epoch seconds)
-- Revokes the key: its digest goes (nothing can authenticate with it again, and admit refuses
-- it at once), its name is free for a new key; the record stays for listings.
-- Returns {"ok", revoked_at}; {"already", revoked_at} when it was revoked before;
--         {"invalid", message}: no key with this id.
local f = redis.call('HMGET', KEYS[2], 'name', 'revoked_at')
if not f[1] then return {'invalid', 'no API key with id ' .. ARGV[1]} end
if f[2] then return {'already', f[2]} end
redis.call('HSET', KEYS[2], 'revoked_at', ARGV[2])
redis.call('HDEL', KEYS[2], 'digest', 'rq', 'tk', 'ts')
if redis.call('HGET', KEYS[1], f[1]) == ARGV[1] then
  redis.call('HDEL', KEYS[1], f[1])
end
return {'ok', ARGV[2]}
