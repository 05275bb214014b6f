-- KEYS[1] = pool settings hash (Keys.pool): HGETALL
-- KEYS[2] = pool members hash (Keys.pool_members): HGETALL
-- KEYS[3] = pool preemption orders hash (Keys.pool_preemptions): HGETALL
-- KEYS[4] = set of pool names (Keys.pools): passed (pool_keys), not touched
-- ARGV: none
-- Read-only: the pool as the next call would see it (lapsed members left out), with each
-- member's entitlement and token share computed.
-- Returns {"ok", JSON}; {"pool", message} when the pool does not exist.
-- @include prelude.lua

local cfg = load_cfg()
if not cfg then return {'pool', 'pool ' .. LABEL .. ' does not exist'} end
local now = now_ms(cfg)
local m, names = load_hash(MEMBERS)
local orders = load_hash(ORDERS)
local live = reclaim(m, names, orders, now, false)
local ent, n_active = block_entitlements(cfg, m, live)
local tokens = token_shares(cfg, m, live)
local members = {}
for _, n in ipairs(live) do
  local s = m[n]
  local use = {}
  for i, u in ipairs(s.use) do use[i] = u end
  members[#members + 1] = {name = n, weight_milli = s.w, held = s.held, active = s.act,
    entitlement = ent[n], loan = s.loan, loan_priority = s.lp, used = used(s),
    blocks_by_priority = use, token_demand = s.td,
    token_budget = tokens and tokens[n] or cjson.null, lease_left_ms = s.exp - now,
    unmet_want = s.uw or 0}
end
local pending = {}
for donor, o in pairs(orders) do
  pending[#pending + 1] = {id = o.id, donor = donor, requester = o.r, priority = o.p,
    blocks = o.n, age_ms = now - o.at, delivered = o.sent}
end
local view = {total = cfg.total, block_size = cfg.block_size, cap_permille = cfg.cap_permille,
  cap = cfg.cap, chunk = cfg.chunk, lease_ms = cfg.lease_ms, preempt_ms = cfg.preempt_ms,
  token_budget = cfg.token_budget, round_ms = cfg.round_ms, clock = cfg.clock,
  created_at = cfg.created_at,
  now_ms = now, held = sum_held(m, live), active_members = n_active,
  reclaimed_blocks = cfg.reclaimed_blocks, lapsed_members = cfg.lapsed_members,
  members = members, preemptions = pending}
return {'ok', cjson.encode(view)}
