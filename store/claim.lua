-- Raise a fragment's epoch so that writers holding an older lease are fenced out (DESIGN §3).
--
-- KEYS[1]  head hash of the fragment
-- ARGV[1]  the claiming shard's epoch
--
-- A fragment with no published version keeps no `version` field: the hash then holds only
-- `epoch`, and readers treat it as "no head". Error "FENCED ..." when a higher epoch claimed it.
local current = redis.call('HGET', KEYS[1], 'epoch')
if current and tonumber(current) > tonumber(ARGV[1]) then
  return redis.error_reply('FENCED fragment epoch ' .. current .. ' > claim epoch ' .. ARGV[1])
end
redis.call('HSET', KEYS[1], 'epoch', ARGV[1])
return 1
