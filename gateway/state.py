"""Typed keys of the gateway's application state (set up in gateway/app.py)."""

from __future__ import annotations

from aiohttp import web
from sqlalchemy.orm import Session, sessionmaker

from gateway.auth import KeyCache
from gateway.router import Router
from gateway.settings import GatewaySettings
from gateway.worker_pool import WorkerPool

SETTINGS = web.AppKey("settings", GatewaySettings)
SESSIONS = web.AppKey("sessions", sessionmaker[Session])
AUTH = web.AppKey("auth", KeyCache)
ADMIN_KEY = web.AppKey("admin_key", str)
POOL = web.AppKey("pool", WorkerPool)
ROUTER = web.AppKey("router", Router)
