-- KEYS, per queue i = 1..n in order: its stream, its config hash, then its r_i routed streams
--      (P:rq:M:L:W of the model's routed workers, docs/routing.md)
-- ARGV[1] = consumer group name
-- ARGV[1+i] = r_i, routed streams of queue i (absent: 0)
-- Returns {"ok", len1, pending1, max_waiting1, policy1, len2, ...}: len and pending summed over
-- the queue's stream and its routed streams; max_waiting and policy are "" when the queue has
-- no stored config (the caller applies the defaults).
local function pending_of(stream)
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if type(groups) == 'table' and not groups.err then
    for _, g in ipairs(groups) do
      local name, p
      for j = 1, #g, 2 do
        if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'pending' then p = g[j + 1] end
      end
      if name == ARGV[1] then return tonumber(p) end
    end
  end
  return 0
end
local out = {'ok'}
local k, i = 1, 1
while k <= #KEYS do
  local length = redis.call('XLEN', KEYS[k])
  local pending = pending_of(KEYS[k])
  local cfg = redis.call('HMGET', KEYS[k + 1], 'max_waiting', 'policy')
  local routed = tonumber(ARGV[1 + i] or '0') or 0
  for r = 1, routed do
    length = length + redis.call('XLEN', KEYS[k + 1 + r])
    pending = pending + pending_of(KEYS[k + 1 + r])
  end
  out[#out + 1] = length
  out[#out + 1] = pending
  out[#out + 1] = cfg[1] or ''
  out[#out + 1] = cfg[2] or ''
  k = k + 2 + routed
  i = i + 1
end
return out
