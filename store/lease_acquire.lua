-- Take a syncer shard's lease and hand out a fresh epoch (DESIGN §3).
--
-- KEYS[1]  lease key (value: owner)
-- KEYS[2]  run-wide epoch counter
-- ARGV[1]  owner
-- ARGV[2]  TTL in milliseconds
--
-- The lease is taken when free, or extended when ARGV[1] already holds it (so a call re-sent
-- after a lost reply does not lock its own owner out). Returns the new epoch, or false when
-- another owner holds the lease.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return redis.call('INCR', KEYS[2])
end
return false
