-- Read a fragment's head and the blobs of that version in one atomic step (no torn reads).
--
-- KEYS[1]  head hash of the fragment
-- ARGV[1]  the fragment's key prefix, e.g. "ddl:{run:3}:"
--
-- The blob keys depend on the head's version, so they are derived here; they carry KEYS[1]'s
-- hash tag and therefore live in the same Redis Cluster slot.
-- Returns false when the fragment has no published version, else
-- {version, epoch, updated_at, value, momentum, meta} (a missing blob is nil).
local head = redis.call('HMGET', KEYS[1], 'version', 'epoch', 'updated_at')
if not head[1] then
  return false
end
local n = head[1]
return {
  n, head[2], head[3],
  redis.call('GET', ARGV[1] .. 'v:' .. n),
  redis.call('GET', ARGV[1] .. 'm:' .. n),
  redis.call('GET', ARGV[1] .. 'meta:' .. n),
}
