"""Typed keys of the gateway's application state (set up in gateway/app.py)."""

from __future__ import annotations

import asyncio

from aiohttp import web
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from accounting.usage_writer import UsageWriter
from gateway.auth.keys import KeyCache
from gateway.quotas.store import QuotaStore
from gateway.settings import GatewaySettings
from gateway.upstream.pool import WorkerPool
from gateway.upstream.router import Router

SETTINGS = web.AppKey("settings", GatewaySettings)
DB = web.AppKey("db", Engine)
SESSIONS = web.AppKey("sessions", sessionmaker[Session])
AUTH = web.AppKey("auth", KeyCache)
ADMIN_KEY = web.AppKey("admin_key", str)
POOL = web.AppKey("pool", WorkerPool)
ROUTER = web.AppKey("router", Router)
QUOTAS = web.AppKey("quotas", QuotaStore)
BACKGROUND = web.AppKey("background_tasks", set[asyncio.Task[None]])  # tasks that outlive their request (billing a hang-up)
WRITER = web.AppKey("usage_writer", UsageWriter)
