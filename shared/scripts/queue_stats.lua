-- KEYS[2i-1] = queue stream              KEYS[2i] = its queue config hash   (i = 1..n)
-- ARGV[1] = consumer group name
-- Returns {"ok", len1, pending1, max_waiting1, policy1, len2, ...}; max_waiting and policy are
-- "" when the queue has no stored config (the caller applies the defaults).
local out = {'ok'}
for i = 1, #KEYS, 2 do
  local pending = 0
  local groups = redis.pcall('XINFO', 'GROUPS', KEYS[i])
  if type(groups) == 'table' and not groups.err then
    for _, g in ipairs(groups) do
      local name, p
      for j = 1, #g, 2 do
        if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'pending' then p = g[j + 1] end
      end
      if name == ARGV[1] then pending = tonumber(p) end
    end
  end
  local cfg = redis.call('HMGET', KEYS[i + 1], 'max_waiting', 'policy')
  out[#out + 1] = redis.call('XLEN', KEYS[i])
  out[#out + 1] = pending
  out[#out + 1] = cfg[1] or ''
  out[#out + 1] = cfg[2] or ''
end
return out
