-- KEYS: none (an include, not a script: `-- @include tf_keep_failed.lua` pastes it into
--       finish.lua, the one script that ends requests ``error``; the caller passes ``dead``
--       from its own KEYS[])
-- ARGV: none
-- A failed request's dead letter: a copy of its stream entry ``sid`` in ``dead`` (the dead-letter
-- stream, Keys.dead_letter) with the reason, its payload cut to ``keep`` bytes, the stream
-- trimmed to about ``maxlen`` entries (shared/dead_letters.py). Kept apart from tf_finish.lua so
-- that the scripts a producer runs (cancel, expire, enqueue) never name the dead-letter stream:
-- a producer's ACL user may not write it (docs/security.md).
local function tf_keep_failed(dead, keep, maxlen, stream, sid, rid, holder, fields)
  local entry = redis.call('XRANGE', stream, sid, sid)[1]
  if not entry then return end
  local payload, code, message = '', '', ''
  for i = 1, #entry[2], 2 do
    if entry[2][i] == 'd' then payload = entry[2][i + 1] end
  end
  for i = 1, #fields, 2 do
    if fields[i] == 'code' then code = fields[i + 1] end
    if fields[i] == 'message' then message = fields[i + 1] end
  end
  redis.call('XADD', dead, 'MAXLEN', '~', maxlen, '*', 'stream', stream,
             'entry_id', sid, 'id', rid, 'reason', code .. ': ' .. message, 'worker', holder,
             'd', string.sub(payload, 1, tonumber(keep)), 'size', tostring(#payload))
end
