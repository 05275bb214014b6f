-- KEYS[1] = the API key's hash (Keys.api_key): HMGET digest rpm tpm rq tk ts; HSET rq tk ts
--           when the request is admitted; HINCRBY refused 1 when it is refused (the buckets
--           are left as they were: the count is what the fleet console shows)
-- ARGV[1] = tokens to charge (an integer >= 0: the gateway's estimate; settle corrects it)
-- ARGV[2] = now in ms for a test clock, or "" for Redis TIME (production: one clock for all)
-- Check-and-charge, atomically: refill both token buckets (requests, capacity rpm; tokens,
-- capacity tpm; each refills its limit per 60 s) to now; admit only if the request bucket holds
-- one request and the token bucket the tokens asked, then take both. A 0 limit is unlimited.
-- Returns {"ok", rpm, tpm, rq, tk}: admitted, levels (units of 1/60000) after the charge;
--         {"limited", rpm, tpm, rq, tk}: refused, the levels found, nothing charged;
--         {"revoked"}: no such key, or it was revoked.
-- @include bucket.lua

local now = now_ms(ARGV[2])
local b = load_buckets(now)
if not b then return {'revoked'} end
local tokens = tonumber(ARGV[1])
if (b.rpm > 0 and b.rq < SCALE) or (b.tpm > 0 and b.tk < tokens * SCALE) then
  redis.call('HINCRBY', KEY, 'refused', 1)
  return {'limited', b.rpm, b.tpm, b.rq, b.tk}
end
if b.rpm > 0 then b.rq = b.rq - SCALE end
if b.tpm > 0 then b.tk = b.tk - tokens * SCALE end
save(b, now)
return {'ok', b.rpm, b.tpm, b.rq, b.tk}
