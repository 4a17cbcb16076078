-- One settle (after prelude.lua): free the slot, move the reserved tokens to the ones used.
-- KEYS: tokens hash, leases zset, budget hash, the key's tokens hash. ARGV[3..]: request id, delta,
-- second, month, holds slot, has a key, budget only (the windows were not charged: the budget alone).
if ARGV[7] == '1' then redis.call('ZREM', KEYS[2], ARGV[3]) end
local delta = tonumber(ARGV[4])
if delta == 0 then return 0 end
local function correct(key)
  local target = nil
  if tonumber(ARGV[5]) > sec - win and redis.call('HEXISTS', key, ARGV[5]) == 1 then
    target = ARGV[5]
  elseif delta > 0 then
    target = sec
  end
  if target then
    if redis.call('HINCRBY', key, target, delta) < 0 then redis.call('HSET', key, target, 0) end
    redis.call('EXPIRE', key, 2 * win)
  end
end
if ARGV[9] ~= '1' then
  correct(KEYS[1])
  if ARGV[8] == '1' then correct(KEYS[4]) end
end
if redis.call('HEXISTS', KEYS[3], ARGV[6]) == 1 then
  if redis.call('HINCRBY', KEYS[3], ARGV[6], delta) < 0 then redis.call('HSET', KEYS[3], ARGV[6], 0) end
end
return 1
