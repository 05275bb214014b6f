-- KEYS[1] = the model's routers (sorted set: worker -> heartbeat expiry, epoch seconds)
-- KEYS[2] = the model's load hash (worker -> "RUNNING MAX_NUM_SEQS STEP_MS LEVELS")
-- KEYS[2 + L*(c-1) + l] = candidate c's routed stream of level l (c = 1 .. C, l = 1 .. L)
-- ARGV[1] = cutoff (epoch seconds): a candidate whose score is above it is kept
-- ARGV[2] = consumer group name          ARGV[3] = L, the routed streams per candidate
-- ARGV[3 + c] = candidate c's name (C = #ARGV - 3)
-- Returns {"ok", name...}: the candidates forgotten.
-- Forgets workers that lapsed long ago (docs/routing.md): a candidate is forgotten only while
-- its score is at most ARGV[1] and every one of its routed streams is empty (no entry, waiting
-- or pending, and no pending id): then it leaves KEYS[1] and KEYS[2] and its routed streams are
-- deleted. Stealers and claimers find a routed stream only through KEYS[1], so a stream that
-- still holds an entry keeps its worker listed until the entry has been taken and has ended.
-- Checked and done in one step: no entry can arrive in between (a worker is routed to only
-- while its score is in the future, and a process that comes back under the name raises it).
local L = tonumber(ARGV[3])
local out = {'ok'}

local function empty(stream)
  if redis.call('XLEN', stream) > 0 then
    return false
  end
  local pending = redis.pcall('XPENDING', stream, ARGV[2])
  return type(pending) ~= 'table' or pending.err ~= nil or tonumber(pending[1]) == 0
end

for c = 1, #ARGV - 3 do
  local name = ARGV[3 + c]
  local score = tonumber(redis.call('ZSCORE', KEYS[1], name) or '')
  if score and score <= tonumber(ARGV[1]) then
    local base = 2 + L * (c - 1)
    local all_empty = true
    for l = 1, L do
      if not empty(KEYS[base + l]) then
        all_empty = false
        break
      end
    end
    if all_empty then
      for l = 1, L do
        redis.call('DEL', KEYS[base + l])
      end
      redis.call('HDEL', KEYS[2], name)
      redis.call('ZREM', KEYS[1], name)
      out[#out + 1] = name
    end
  end
end
return out
