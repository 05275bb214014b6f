-- KEYS[1] = the API key's hash (Keys.api_key): HMGET digest rpm tpm rq tk ts (read-only:
--           nothing is written)
-- ARGV[1] = now in ms for a test clock, or "" for Redis TIME (as api_key_admit.lua)
-- The key's two buckets refilled to now, as the next admit would find them (the fleet console
-- shows how much of each limit is in use).
-- Returns {"ok", rpm, tpm, rq, tk} (levels in units of 1/60000, quota.SCALE);
--         {"revoked"}: no such key, or it was revoked.
-- @include bucket.lua

local b = load_buckets(now_ms(ARGV[1]))
if not b then return {'revoked'} end
return {'ok', b.rpm, b.tpm, b.rq, b.tk}
