-- The prelude of admit.lua and settle.lua (gateway/quotas/redis_store.py joins them): the time
-- `now` (ARGV[1], else the Redis server's clock), its whole second `sec`, and the window `win` (ARGV[2]).
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local sec = math.floor(now)
local win = tonumber(ARGV[2])
