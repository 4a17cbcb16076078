-- One admission, atomic: check every limit, then charge every counter or none (after prelude.lua).
-- The same rules as gateway/quotas/rules.py's window / refusal (the shared test suite holds both to them).
-- KEYS: requests hash, tokens hash, leases zset, budget hash, seeded-months hash, the key's requests
-- and tokens hashes. ARGV[3..]: rpm, tpm, max_concurrent, budget (-1 = unlimited), request id,
-- reserve, lease seconds, require a seeded month (1/0), key rpm, key tpm, has a key (1/0), budget only (1/0:
-- a batch line, which charges the month's budget and no window counter or slot).
local rpm, tpm, maxc, budget = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local rid, reserve, lease = ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9])
local need_seed, key_rpm, key_tpm, has_key = ARGV[10] == '1', tonumber(ARGV[11]), tonumber(ARGV[12]), ARGV[13] == '1'
local budget_only = ARGV[14] == '1'

local function window(key, extra, limit)
  local flat = redis.call('HGETALL', key)
  local buckets, stale, used, newest = {}, {}, 0, -1
  for i = 1, #flat, 2 do
    local s, n = tonumber(flat[i]), tonumber(flat[i + 1])
    if s <= sec - win then
      stale[#stale + 1] = flat[i]
    else
      buckets[#buckets + 1] = {s, n}
      used = used + n
      if n > 0 and s > newest then newest = s end
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  if limit < 0 or used + extra <= limit then return used, 0, newest end
  table.sort(buckets, function(a, b) return a[1] < b[1] end)
  local left = used
  for _, b in ipairs(buckets) do
    left = left - b[2]
    if left + extra <= limit then return used, b[1] + win - now, newest end
  end
  return used, -1, newest
end

-- UTC YYYYMM of an epoch second (civil_from_days, H. Hinnant).
local function month_of(s)
  local z = math.floor(s / 86400) + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y * 100 + m
end

local month = month_of(sec)
if need_seed and redis.call('HEXISTS', KEYS[5], month) == 0 then
  return {-1, month}  -- the month's spend is not known here yet (first use, or Redis lost its keys)
end
local r_used, r_wait, r_newest = window(KEYS[1], 1, rpm)
local t_used, t_wait, t_newest = window(KEYS[2], reserve, tpm)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', string.format('%.17g', now))
local conc = redis.call('ZCARD', KEYS[3])
local spent = tonumber(redis.call('HGET', KEYS[4], month) or '0')
local kr_used, kr_wait, kr_newest, kt_used, kt_wait, kt_newest = 0, 0, -1, 0, 0, -1
if has_key then
  kr_used, kr_wait, kr_newest = window(KEYS[6], 1, key_rpm)
  kt_used, kt_wait, kt_newest = window(KEYS[7], reserve, key_tpm)
end

local refused = (budget >= 0 and spent + reserve > budget) or (rpm >= 0 and r_used + 1 > rpm)
  or (tpm >= 0 and t_used + reserve > tpm) or (maxc >= 0 and conc >= maxc)
  or (has_key and ((key_rpm >= 0 and kr_used + 1 > key_rpm) or (key_tpm >= 0 and kt_used + reserve > key_tpm)))
local holds = 0
if not refused then
  if not budget_only then
    redis.call('HINCRBY', KEYS[1], sec, 1)
    redis.call('EXPIRE', KEYS[1], 2 * win)
    redis.call('HINCRBY', KEYS[2], sec, reserve)
    redis.call('EXPIRE', KEYS[2], 2 * win)
    if has_key then
      redis.call('HINCRBY', KEYS[6], sec, 1)
      redis.call('EXPIRE', KEYS[6], 2 * win)
      redis.call('HINCRBY', KEYS[7], sec, reserve)
      redis.call('EXPIRE', KEYS[7], 2 * win)
    end
  end
  redis.call('HINCRBY', KEYS[4], month, reserve)
  redis.call('EXPIRE', KEYS[4], 70 * 86400)
  local prev = (month % 100 == 1) and (month - 89) or (month - 1)
  for _, m in ipairs(redis.call('HKEYS', KEYS[4])) do
    if tonumber(m) < prev then redis.call('HDEL', KEYS[4], m) end
  end
  if maxc >= 0 and not budget_only then
    redis.call('ZADD', KEYS[3], string.format('%.17g', now + lease), rid)
    redis.call('EXPIRE', KEYS[3], math.ceil(lease) + win)
    holds = 1
  end
end
return {refused and 0 or 1, string.format('%.17g', now), sec, month, r_used, string.format('%.17g', r_wait),
  r_newest, t_used, string.format('%.17g', t_wait), t_newest, conc, spent, holds,
  kr_used, string.format('%.17g', kr_wait), kr_newest, kt_used, string.format('%.17g', kt_wait), kt_newest}
