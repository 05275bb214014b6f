-- KEYS, per queue i = 1..n in order: its stream, its config hash, then its r_i routed streams
--      (P:rq:M:L:W of the model's routed workers, docs/routing.md), then its t_i tenant queues
--      (P:tq:M:L:T of its active tenants, docs/fairness.md: no group, every entry waits)
-- ARGV[1] = consumer group name
-- ARGV[1+i] = "r_i" or "r_i t_i": routed streams and tenant queues of queue i (absent: 0)
-- Returns {"ok", len1, pending1, max_waiting1, policy1, oldest1, len2, ...}: len and pending
-- summed over the queue's stream and its routed streams; max_waiting and policy are "" when the
-- queue has no stored config (the caller applies the defaults); oldest is the id of the oldest
-- waiting (undelivered) entry over those streams, "" when none waits (its first part is the
-- epoch milliseconds at which it was added: one XRANGE ... COUNT 1 per stream finds it).
local function group_of(stream)  -- pending count and last-delivered id of the workers' group
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if type(groups) == 'table' and not groups.err then
    for _, g in ipairs(groups) do
      local name, p, last
      for j = 1, #g, 2 do
        if g[j] == 'name' then name = g[j + 1]
        elseif g[j] == 'pending' then p = g[j + 1]
        elseif g[j] == 'last-delivered-id' then last = g[j + 1] end
      end
      if name == ARGV[1] then return tonumber(p), last end
    end
  end
  return 0, nil
end
local function id_ms(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function older(a, b)  -- stream id a before b ("" is after everything)
  if b == '' then return true end
  local am, as = id_ms(a)
  local bm, bs = id_ms(b)
  return am < bm or (am == bm and as < bs)
end
local function count(stream, oldest)  -- its pending count, and the older of oldest and its own
  local pending, last = group_of(stream)
  local first = redis.call('XRANGE', stream, last and ('(' .. last) or '-', '+', 'COUNT', 1)[1]
  if first and older(first[1], oldest) then oldest = first[1] end
  return pending, oldest
end
local out = {'ok'}
local k, i = 1, 1
while k <= #KEYS do
  local length = redis.call('XLEN', KEYS[k])
  local pending, oldest = count(KEYS[k], '')
  local cfg = redis.call('HMGET', KEYS[k + 1], 'max_waiting', 'policy')
  local r_s, t_s = string.match(ARGV[1 + i] or '0', '^(%d+) ?(%d*)$')
  local routed = (tonumber(r_s or '0') or 0) + (tonumber(t_s or '') or 0)
  for r = 1, routed do
    local more
    length = length + redis.call('XLEN', KEYS[k + 1 + r])
    more, oldest = count(KEYS[k + 1 + r], oldest)
    pending = pending + more
  end
  out[#out + 1] = length
  out[#out + 1] = pending
  out[#out + 1] = cfg[1] or ''
  out[#out + 1] = cfg[2] or ''
  out[#out + 1] = oldest
  k = k + 2 + routed
  i = i + 1
end
return out
