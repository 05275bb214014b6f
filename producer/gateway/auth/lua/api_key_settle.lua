-- KEYS[1] = the API key's hash (Keys.api_key): HMGET digest rpm tpm rq tk ts; HSET rq tk ts
-- ARGV[1] = tokens charged at admit   ARGV[2] = tokens the request really used
-- ARGV[3] = now in ms for a test clock, or "" for Redis TIME
-- Corrects the token bucket by (charged - used): a refund fills it at most to its capacity;
-- an overrun takes it down to a debt of at most one capacity (-tpm units), the rest is
-- forgiven. Both buckets are refilled to now first (they share one timestamp).
-- Returns {"ok", tk}: the token level after (0 for a key without a token limit);
--         {"revoked"}: no such key or revoked, nothing written.
-- @include bucket.lua

local now = now_ms(ARGV[3])
local b = load_buckets(now)
if not b then return {'revoked'} end
local delta = tonumber(ARGV[1]) - tonumber(ARGV[2])
if b.tpm <= 0 or delta == 0 then return {'ok', b.tk} end
local cap = b.tpm * SCALE
b.tk = math.max(-cap, math.min(cap, b.tk + delta * SCALE))
save(b, now)
return {'ok', b.tk}
