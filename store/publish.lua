-- Atomic compare-and-set publish of one fragment version (DESIGN §2 step 6, §3).
--
-- KEYS[1]  head hash of the fragment (fields version, epoch, updated_at, token)
-- KEYS[2]  value blob key of the new version
-- KEYS[3]  momentum blob key of the new version
-- KEYS[4]  meta key of the new version
-- KEYS[5..] blob keys of versions that leave the kept window (deleted; absent ones are no-ops)
-- ARGV[1]  expected head version (-1: the fragment has no published version yet)
-- ARGV[2]  writer epoch (from the shard's lease)
-- ARGV[3]  value bytes
-- ARGV[4]  momentum bytes
-- ARGV[5]  meta JSON
-- ARGV[6]  updated_at, wall-clock seconds as text
-- ARGV[7]  write token of this call: the round's token when the writer gives one (a shard
--          that lost a reply compares it with the head's to learn whether its round is in)
-- ARGV[8]  merge ledger, JSON [[learner_incarnation, first_seq, last_seq], ...] ("[]": none)
--
-- The head hash also holds the ledger: field "merged:<learner>:<incarnation>" is the highest
-- wire sequence number of that learner incarnation merged into the fragment. A learner's
-- deltas reach a fragment's round in sequence order and rounds are published in order, so a
-- publish naming a sequence at or below that field would merge a delta a second time.
--
-- Returns the new version. Errors (nothing is written): "FENCED ..." when the fragment was
-- claimed by a higher epoch, "VERSION_CONFLICT ..." when the head is not the expected version,
-- "ALREADY_MERGED ..." when the ledger shows a named delta merged before.
local head = redis.call('HMGET', KEYS[1], 'version', 'epoch', 'token')
local current = -1
if head[1] then current = tonumber(head[1]) end
local head_epoch = -1
if head[2] then head_epoch = tonumber(head[2]) end
local expected = tonumber(ARGV[1])
local epoch = tonumber(ARGV[2])

-- redis-py re-sends a command whose reply was lost on a dropped connection. If this very call
-- already succeeded, the head carries its token: answer as the first execution did.
if current == expected + 1 and head[3] == ARGV[7] then
  return current
end
-- Fencing first: a writer whose lease was taken over must stop, not re-read and retry as it
-- would on a plain version conflict.
if epoch < head_epoch then
  return redis.error_reply('FENCED fragment epoch ' .. head_epoch .. ' > writer epoch ' .. epoch)
end
if current ~= expected then
  return redis.error_reply('VERSION_CONFLICT head version ' .. current ..
    ', expected ' .. expected)
end

local ledger = cjson.decode(ARGV[8])
for _, entry in ipairs(ledger) do
  local last = tonumber(redis.call('HGET', KEYS[1], 'merged:' .. entry[1]) or '-1')
  if tonumber(entry[2]) <= last then
    return redis.error_reply('ALREADY_MERGED ' .. entry[1] .. ' seq ' .. entry[2] ..
      ' <= merged ' .. last)
  end
end

local new = expected + 1
redis.call('SET', KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], ARGV[4])
redis.call('SET', KEYS[4], ARGV[5])
redis.call('HSET', KEYS[1], 'version', new, 'epoch', epoch, 'updated_at', ARGV[6],
  'token', ARGV[7])
for _, entry in ipairs(ledger) do
  redis.call('HSET', KEYS[1], 'merged:' .. entry[1], entry[3])
end
for i = 5, #KEYS do
  redis.call('DEL', KEYS[i])
end
return new
