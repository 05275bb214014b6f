-- KEYS[1] = the batch's ledger hash (line index -> "ok" | "err")
-- KEYS[2] = the batch hash                KEYS[3] = the output file's line list
-- KEYS[4] = the error file's line list
-- ARGV[1] = line index                    ARGV[2] = "ok" (output) or "err" (error file)
-- ARGV[3] = the JSONL line to write (no newline)
-- Records one line's result exactly once: writes it only if the ledger has no entry for the
-- index (HSETNX), and counts it (completed / failed, and the file's bytes). Returns
-- {"ok", 1} when it wrote, {"ok", 0} when the index was recorded before (nothing written).
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return {'ok', 0}
end
if ARGV[2] == 'ok' then
  redis.call('RPUSH', KEYS[3], ARGV[3])
  redis.call('HINCRBY', KEYS[2], 'completed', 1)
  redis.call('HINCRBY', KEYS[2], 'output_bytes', string.len(ARGV[3]) + 1)
else
  redis.call('RPUSH', KEYS[4], ARGV[3])
  redis.call('HINCRBY', KEYS[2], 'failed', 1)
  redis.call('HINCRBY', KEYS[2], 'error_bytes', string.len(ARGV[3]) + 1)
end
return {'ok', 1}
