-- KEYS: none of its own (an include, not a script: each pool script pastes it after its own
--       KEYS/ARGV header with `-- @include prelude.lua`; it is never run alone).
-- Shared local functions of the pool scripts. Expects KEYS[1] = pool settings hash, KEYS[2] = pool members hash, KEYS[3] = pool preemption
-- orders hash, and (ensure_pool only) KEYS[4] = set of pool names. Every key it touches is one
-- of these: no key name is built here.
-- The accounting rules these functions implement: worker/pool/scripts.py (its docstring).

-- Mirrors of tokenfleet.worker.pool.config.DEFAULT_ROUND_MS and MAX_MEMBERS (a test checks
-- that they agree).
local DEFAULT_ROUND_MS = 100
local MAX_MEMBERS = 256

local POOL, MEMBERS, ORDERS = KEYS[1], KEYS[2], KEYS[3]
-- The pool's name for messages: the last segment of its key (names hold no ':').
local LABEL = string.match(POOL, '([^:]+)$') or POOL
local NUMERIC = {'total', 'block_size', 'cap_permille', 'chunk', 'lease_ms', 'preempt_ms',
                 'token_budget', 'round_ms', 'manual_now_ms', 'created_at', 'order_seq',
                 'reclaimed_blocks', 'lapsed_members'}

local function load_cfg()
  local flat = redis.call('HGETALL', POOL)
  if #flat == 0 then return nil end
  local cfg = {}
  for i = 1, #flat, 2 do cfg[flat[i]] = flat[i + 1] end
  for _, k in ipairs(NUMERIC) do cfg[k] = tonumber(cfg[k]) or 0 end
  if cfg.round_ms <= 0 then cfg.round_ms = DEFAULT_ROUND_MS end
  cfg.cap = math.max(1, math.floor(cfg.total * cfg.cap_permille / 1000))
  return cfg
end

local function now_ms(cfg)
  if cfg.clock == 'manual' then return cfg.manual_now_ms end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function load_hash(key)
  local flat = redis.call('HGETALL', key)
  local out, names = {}, {}
  for i = 1, #flat, 2 do
    out[flat[i]] = cjson.decode(flat[i + 1])
    names[#names + 1] = flat[i]
  end
  table.sort(names)
  return out, names
end

-- Drop lapsed members (their blocks return) and orders that name a gone member or lapsed.
-- Returns the sorted names of live members. Writes only when `write` is true.
local function reclaim(m, names, orders, now, write)
  local live = {}
  for _, n in ipairs(names) do
    local s = m[n]
    if s.exp <= now then
      m[n] = nil
      if write then
        redis.call('HDEL', MEMBERS, n)
        redis.call('HINCRBY', POOL, 'lapsed_members', 1)
        if s.held > 0 then redis.call('HINCRBY', POOL, 'reclaimed_blocks', s.held) end
      end
    else
      live[#live + 1] = n
    end
  end
  for donor, o in pairs(orders) do
    if m[donor] == nil or m[o.r] == nil or o.exp <= now then
      orders[donor] = nil
      if write then redis.call('HDEL', ORDERS, donor) end
    end
  end
  return live
end

-- Weighted split of `total` among `names` (sorted), water-filled under cap_of[name]:
-- floor shares, remainder one each by largest fractional part then name.
local function split(total, names, weight_of, cap_of)
  local share, open, remaining = {}, {}, total
  for _, n in ipairs(names) do open[#open + 1] = n end
  while #open > 0 do
    local wsum = 0
    for _, n in ipairs(open) do wsum = wsum + weight_of[n] end
    local rest, capped = {}, 0
    for _, n in ipairs(open) do
      if remaining * weight_of[n] >= cap_of[n] * wsum then
        share[n] = cap_of[n]
        capped = capped + cap_of[n]
      else
        rest[#rest + 1] = n
      end
    end
    if #rest == #open then
      local given, frac = 0, {}
      for _, n in ipairs(open) do
        local p = remaining * weight_of[n]
        local q = math.floor(p / wsum)
        share[n] = q
        given = given + q
        frac[#frac + 1] = {n, p - q * wsum}
      end
      table.sort(frac, function(a, b)
        if a[2] ~= b[2] then return a[2] > b[2] end
        return a[1] < b[1]
      end)
      for i = 1, remaining - given do share[frac[i][1]] = share[frac[i][1]] + 1 end
      break
    end
    remaining = remaining - capped
    open = rest
  end
  return share
end

local function block_entitlements(cfg, m, live)
  local active, w, cap = {}, {}, {}
  for _, n in ipairs(live) do
    if m[n].act == 1 then
      active[#active + 1] = n
      w[n] = m[n].w
      cap[n] = cfg.cap
    end
  end
  local share = split(cfg.total, active, w, cap)
  for _, n in ipairs(live) do share[n] = share[n] or 0 end
  return share, #active
end

local function token_shares(cfg, m, live)
  if cfg.token_budget <= 0 then return nil end
  local asking, w, cap = {}, {}, {}
  for _, n in ipairs(live) do
    if m[n].td > 0 then
      asking[#asking + 1] = n
      w[n] = m[n].w
      cap[n] = math.min(m[n].td, cfg.token_budget)
    end
  end
  local share = split(cfg.token_budget, asking, w, cap)
  for _, n in ipairs(live) do share[n] = share[n] or 0 end
  return share
end

local function sum_held(m, live)
  local t = 0
  for _, n in ipairs(live) do t = t + m[n].held end
  return t
end

local function used(s)
  local t = 0
  for _, u in ipairs(s.use) do t = t + u end
  return t
end

-- Least urgent priority with running work, or -1 when nothing runs.
local function least_urgent(s)
  local lu = -1
  for i, u in ipairs(s.use) do if u > 0 then lu = i - 1 end end
  return lu
end

-- Blocks a donor can give up for a request of priority p: spare plus work less urgent than p.
local function freeable(s, p)
  local f = math.max(0, s.held - used(s))
  for i, u in ipairs(s.use) do if i - 1 > p then f = f + u end end
  return math.min(f, s.held)
end

local function new_member(w, now, lease_ms)
  return {w = w, held = 0, act = 0, use = {}, td = 0, loan = 0, lp = 0, inbox = 0, uw = 0,
          exp = now + lease_ms}
end

local function save(name, s) redis.call('HSET', MEMBERS, name, cjson.encode(s)) end

-- Create the pool from ARGV[first..first+9] unless it exists; returns (cfg, created) or an
-- error reply as the first value's 'err' field.
local function ensure_pool(first)
  local total, block_size = tonumber(ARGV[first]), tonumber(ARGV[first + 1])
  local cfg = load_cfg()
  if cfg then
    if total > 0 and (cfg.total ~= total or cfg.block_size ~= block_size) then
      return {err = 'pool ' .. LABEL .. ' exists with ' .. cfg.total .. ' blocks of ' ..
              cfg.block_size .. ' tokens; asked for ' .. total .. ' blocks of ' .. block_size}
    end
    return cfg, 0
  end
  if total <= 0 then
    return {err = 'pool ' .. LABEL .. ' does not exist: create it with tokenfleet pool create ' ..
            'or give the first member its size'}
  end
  redis.call('HSET', POOL, 'total', total, 'block_size', block_size,
             'cap_permille', ARGV[first + 2], 'chunk', ARGV[first + 3],
             'lease_ms', ARGV[first + 4], 'preempt_ms', ARGV[first + 5],
             'token_budget', ARGV[first + 6], 'clock', ARGV[first + 7],
             'round_ms', ARGV[first + 9],
             'manual_now_ms', 0, 'order_seq', 0, 'reclaimed_blocks', 0, 'lapsed_members', 0)
  cfg = load_cfg()
  local now = now_ms(cfg)
  redis.call('HSET', POOL, 'created_at', now)
  redis.call('SADD', KEYS[4], ARGV[first + 8])
  cfg.created_at = now
  return cfg, 1
end
