-- KEYS: none (an include, not a script: `-- @include tf_route.lua` pastes it into enqueue.lua,
--       and, before tf_tenants.lua, which routes admitted requests with route_target, into
--       worker_pull.lua, worker_overflow.lua and finish.lua; its functions take the keys they
--       use as arguments, every one from the caller's KEYS[])
-- ARGV: none
-- Routing (docs/routing.md) for one enqueue call. A call names its candidate workers (the
-- model's routers the producer knows of), each with two keys: KEYS[base + 2c] its prefix set,
-- KEYS[base + 2c + 1] its routed stream of this queue (KEYS[base] is the routers set,
-- KEYS[base + 1] the model's load hash). new_router() returns a table with:
--   waiting(): undelivered entries over the candidates' routed streams
--   pick(session index into KEYS or nil, chain): index of the chosen candidate (or nil: shared stream) and
--     the route ("session" | "prefix:N"), pinning the session to the chosen worker
--   added(c): one more entry is waiting in candidate c's routed stream
-- Candidate c is live while its score in the routers set is above now and it serves the
-- queue's level (the load hash's 4th field lists its levels; absent: all): route_target(); it
-- is a target while its load (undelivered routed entries + the running its heartbeat reported)
-- is below twice its max_num_seqs (a prefix hit is worth a short wait; stealers take what waits
-- too long). The same rule decides, when a request routed while it waited in a tenant queue is
-- admitted, whether its worker still takes it (tf_tenants.lua).
-- Worker `name` as a routing target of a queue of `level`, from the routers set `routers` and
-- the load hash `loads`: whether it is live, what its heartbeat says it runs, its max_num_seqs.
local function route_target(routers, loads, name, now, level)
  local score = redis.call('ZSCORE', routers, name)
  local live = score ~= false and score ~= nil and tonumber(score) > now
  local load = redis.call('HGET', loads, name) or ''
  local levels = string.match(load, '^%d+ %d+ %d+ (%S+)')
  if levels and not string.find(',' .. levels .. ',', ',' .. level .. ',', 1, true) then
    live = false
  end
  local running, cap = string.match(load, '^(%d+) (%d+)')
  return live, tonumber(running or '') or 0, tonumber(cap or '') or 32
end

local function new_router(base, names, now, session_ttl, undelivered, level)
  local r = {n = #names, load = {}, live = {}, cap = {}, queued = {}}
  for c = 1, r.n do
    local running
    r.live[c], running, r.cap[c] = route_target(KEYS[base], KEYS[base + 1], names[c], now, level)
    r.queued[c] = undelivered(KEYS[base + 2 * c + 1])
    r.load[c] = r.queued[c] + running
  end
  function r.waiting()
    local total = 0
    for c = 1, r.n do total = total + r.queued[c] end
    return total
  end
  function r.eligible(c)
    return r.live[c] and r.load[c] < 2 * r.cap[c]
  end
  function r.added(c)
    r.queued[c] = r.queued[c] + 1
    r.load[c] = r.load[c] + 1
  end
  function r.least_loaded()
    local best = nil
    for c = 1, r.n do
      if r.eligible(c) and (not best or r.load[c] < r.load[best]) then best = c end
    end
    return best
  end
  -- The holder of the longest cached run, weighed against its load: a candidate scores its
  -- matched links minus its load in units of its max_num_seqs (a full batch of work ahead of
  -- the request costs one link); the best positive score wins, the less loaded on a tie. No
  -- positive score: no useful match (the caller sends it to the shared stream).
  function r.longest(chain)
    if #chain == 0 then return nil, 0 end
    local best, best_m, best_score = nil, 0, 0
    for c = 1, r.n do
      if r.eligible(c) then
        local hits = redis.call('SMISMEMBER', KEYS[base + 2 * c], unpack(chain))
        local m = 0
        while m < #hits and hits[m + 1] == 1 do m = m + 1 end
        local score = m - r.load[c] / r.cap[c]
        if m > 0 and score > 0 and (score > best_score
            or (score == best_score and r.load[c] < r.load[best])) then
          best, best_m, best_score = c, m, score
        end
      end
    end
    return best, best_m
  end
  function r.pick(session, chain)
    local chosen, route = nil, nil
    if session then
      local pinned = redis.call('GET', KEYS[session])
      for c = 1, r.n do
        if names[c] == pinned and r.eligible(c) then chosen, route = c, 'session' end
      end
    end
    if not chosen then
      local c, m = r.longest(chain)
      if c then chosen, route = c, 'prefix:' .. m end
    end
    if not chosen and session then
      chosen = r.least_loaded()
      if chosen then route = 'session' end
    end
    if chosen and session then
      redis.call('SET', KEYS[session], names[chosen], 'EX', session_ttl)
    end
    return chosen, route
  end
  return r
end
