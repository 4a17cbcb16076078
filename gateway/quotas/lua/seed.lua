-- Seeds a scope's budget counter for a month, once (no prelude: it needs no clock).
-- KEYS: seeded-months hash, budget hash. ARGV: month (YYYYMM), tokens spent before (usage_events).
-- Once per month and scope (until Redis loses the keys): concurrent seeders add it only once.
if redis.call('HSETNX', KEYS[1], ARGV[1], 1) == 1 then
  local spent = tonumber(ARGV[2])
  if spent > 0 then
    redis.call('HINCRBY', KEYS[2], ARGV[1], spent)
    redis.call('EXPIRE', KEYS[2], 70 * 86400)
  end
end
redis.call('EXPIRE', KEYS[1], 70 * 86400)
return 1
