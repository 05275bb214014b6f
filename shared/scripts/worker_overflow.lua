-- KEYS[1..n] = streams to take aged entries from, in the order to take them: an overflow
--              worker's (--overflow-for) shared and routed streams of its model (n = ARGV[5])
-- KEYS[n+2j-1], KEYS[n+2j] = the active-tenant set (Keys.tenants_active) and the tenant backlog
--              (Keys.tenant_backlog) of the j-th shared stream that has a tenant-queue name in
--              ARGV (below), j = 1 .. m; when m > 0, then KEYS[n+2m+1] = the model's tenant book
--              (Keys.tenant_book), KEYS[n+2m+2] = the cancel set, KEYS[n+2m+3] = the queue ends
--              hash (Keys.tally): what ending an expired request at admission needs
-- ARGV[1] = consumer group name          ARGV[2] = consumer (the overflow worker's name)
-- ARGV[3] = budget: entries to take at most, over all streams
-- ARGV[4] = minimum age in milliseconds (the overflow threshold)
-- ARGV[5] = n, the number of streams
-- ARGV[5+i] = entries to take at most from KEYS[i] (negative: no own cap)
-- ARGV[5+n+i] = level of KEYS[i]: streams of one level share the cap given for the first
-- ARGV[5+2n+i] = minimum age for KEYS[i] in milliseconds ("" or absent: ARGV[4])
-- ARGV[5+3n+i] = for a shared stream KEYS[i], its tenant queues' name before the tenant
--              (Keys.tenant_queue with tenant ""); "" for a routed stream
-- ARGV[6+4n], ARGV[7+4n] = a request record's name before and after the request id
-- ARGV[8+4n .. 17+4n] (when m > 0) = what ending an expired request needs, as PULL's: now
--              (epoch seconds), record TTL, publish command, a token list's and a channel's name
--              around the id, the "expired" event with its placeholder, the message
-- Returns {"ok", reply...}: one XREADGROUP reply ({stream, entries}) per stream it took from.
-- Work that has waited at least the threshold since it was enqueued is taken, oldest first
-- (tf_take.lua; an entry admitted from a tenant queue is as old as its field o). Tenants
-- (docs/fairness.md, tf_tenants.lua): when every undelivered entry of a shared stream was taken
-- and there is room left, requests are admitted from its tenant queues whose head has waited
-- that long, the least virtual time first and charged as any admission (tt_admit_aged; one
-- past its deadline is ended "expired" instead), and taken in the same call: an overflow pool
-- works through tenant backlogs too, fairly.
-- @include tf_finish.lua
-- @include tf_route.lua
-- @include tf_tenants.lua
-- @include tf_take.lua

local n = tonumber(ARGV[5])
local tenanted, m = {}, 0  -- stream index -> j (its tenant keys are KEYS[n + 2j - 1 .. n + 2j])
for i = 1, n do
  local tq = ARGV[5 + 3 * n + i]
  if tq and tq ~= '' then
    m = m + 1
    tenanted[i] = m
  end
end
local book = KEYS[n + 2 * m + 1]
local rec_pre, rec_suf = ARGV[6 + 4 * n], ARGV[7 + 4 * n]

-- end request `rid`, met at admission past its deadline (its tenant-queue entry is deleted)
local function expire(queue, rid)
  tt_expire(8 + 4 * n, queue, rid, rec_pre, rec_suf, KEYS[n + 2 * m + 2], KEYS[n + 2 * m + 3],
            ARGV[1])
end

local function admit(i, room, now_ms, age)
  local j = tenanted[i]
  if not j then return 0 end
  local active, backlog = KEYS[n + 2 * j - 1], KEYS[n + 2 * j]
  if redis.call('ZCARD', active) == 0 then return 0 end
  return tt_admit_aged(room, KEYS[i], active, backlog, book, ARGV[5 + 3 * n + i], rec_pre,
                       rec_suf, now_ms, age, expire)
end

return tf_take(n, ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), 5, 5 + n, 5 + 2 * n,
               admit)
