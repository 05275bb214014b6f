-- KEYS: none (an include, not a script: `-- @include tf_backlog.lua` pastes it into
--       tf_tenants.lua, cancel.lua and expire_overdue.lua; its functions take their keys as
--       arguments, from the caller's KEYS[])
-- ARGV: none
-- A queue's tenant backlog (Keys.tenant_backlog, P:tlen:M:L): a list with one element per entry
-- of the queue's tenant queues, so that its LLEN is their total: what KEDA's redis (list)
-- trigger reads and adds to the shared stream's lag (deploy/k8s/keda.yaml). Every XADD to a
-- tenant queue pushes one element, every XDEL that removed an entry pops one (tf_tenants.lua).

-- grow (delta > 0) or shrink (delta < 0) the backlog list by |delta| elements; nil: none kept
local function tt_backlog(backlog, delta)
  if not backlog then return end
  if delta < 0 then
    redis.call('LPOP', backlog, -delta)  -- (a count: Redis >= 6.2)
    return
  end
  local ones = {}
  for i = 1, math.min(delta, 1000) do ones[i] = '1' end
  while delta > 0 do
    local k = math.min(delta, 1000)
    redis.call('RPUSH', backlog, unpack(ones, 1, k))
    delta = delta - k
  end
end

-- take the entry `sid` of a request out of tenant queue `queue` (cancel, expiry); returns "":
-- nothing is left for tf_finish to ack or delete
local function tt_withdraw(queue, sid, backlog)
  if sid ~= '' and redis.call('XDEL', queue, sid) == 1 then tt_backlog(backlog, -1) end
  return ''
end
