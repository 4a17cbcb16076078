"""Model prices per 1M tokens, with their history.

Each model has at most one open price (effective_to None); setting a new price closes it at the new
price's effective_from, so a model's prices form a chain of adjacent, non-overlapping intervals
[effective_from, effective_to) and every instant has at most one price. Like `accounting.tenants`,
every function works on a caller-owned `Session` (flush, never commit) and raises subclasses of
`AccountingError` on bad input.
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from accounting.models import Price, utcnow
from accounting.tenants import AccountingError

MODEL_NAME_MAX_LENGTH = 200
PRICE_MAX_DIGITS, PRICE_SCALE = 18, 6  # models.MONEY = Numeric(18, 6)
DISCOUNT_SCALE = 4  # Price.batch_discount = Numeric(5, 4)
PriceValue = Decimal | int | str | float
"""A price as given: Decimal, int, decimal string, or float (read as its shortest repr: 0.1 → 0.1)."""


class InvalidPriceError(AccountingError):
    """A price, discount, model name or date is malformed or out of range."""


class PriceNotFoundError(AccountingError):
    """No price matches."""


def to_decimal(field: str, value: object, scale: int = PRICE_SCALE) -> Decimal:
    """`value` as an exact, finite, non-negative Decimal with at most `scale` decimal places.

    More places than the column keeps are refused rather than silently rounded.
    """
    if isinstance(value, bool):
        raise InvalidPriceError(f"{field} must be a number, got {value!r}", field=field)
    try:
        if isinstance(value, float):
            number = Decimal(repr(value))
        elif isinstance(value, Decimal | int | str):
            number = Decimal(value.strip() if isinstance(value, str) else value)
        else:
            raise InvalidPriceError(f"{field} must be a number, got {value!r}", field=field)
    except InvalidOperation as error:
        raise InvalidPriceError(f"{field} must be a number, got {value!r}", field=field) from error
    if not number.is_finite():
        raise InvalidPriceError(f"{field} must be a finite number, got {value!r}", field=field)
    if number < 0:
        raise InvalidPriceError(f"{field} must be 0 or more, got {value}", field=field)
    if number.adjusted() >= PRICE_MAX_DIGITS - PRICE_SCALE:
        raise InvalidPriceError(f"{field} is too large: {value}", field=field)
    quantum = Decimal(1).scaleb(-scale)
    if number != number.quantize(quantum):
        raise InvalidPriceError(f"{field} has more than {scale} decimal places: {value}", field=field)
    return number.quantize(quantum)


def parse_when(text: str) -> datetime:
    """An ISO 8601 date ("2026-01-01" = midnight UTC) or datetime (naive = UTC) as an aware UTC datetime."""
    if not isinstance(text, str):
        raise InvalidPriceError(f"expected an ISO 8601 date or datetime, got {text!r}", field="effective_from")
    try:
        if len(text.strip()) == 10:
            day = date.fromisoformat(text.strip())
            return datetime(day.year, day.month, day.day, tzinfo=UTC)
        when = datetime.fromisoformat(text.strip())
    except ValueError as error:
        raise InvalidPriceError(f"expected an ISO 8601 date or datetime (YYYY-MM-DD), got {text!r}",
                                field="effective_from") from error
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def _check_model(model: object) -> str:
    if not isinstance(model, str) or not model.strip() or len(model) > MODEL_NAME_MAX_LENGTH:
        raise InvalidPriceError(f"model must be a non-empty name of at most {MODEL_NAME_MAX_LENGTH} characters",
                                field="model")
    return model


def open_price(session: Session, model: str) -> Price | None:
    """The model's open-ended (latest) price, if any."""
    return session.scalar(select(Price).where(Price.model == model, Price.effective_to.is_(None))
                          .order_by(Price.effective_from.desc()).limit(1))


def set_price(
    session: Session, model: str, *, input_per_mtok: PriceValue, cached_input_per_mtok: PriceValue,
    output_per_mtok: PriceValue, batch_discount: PriceValue = Decimal(0), effective_from: datetime | None = None,
) -> Price:
    """Give `model` new prices per 1M tokens from `effective_from` (default: now) on.

    The model's open price ends where the new one starts. A start before the open price's start is
    refused (history is never rewritten); the same start replaces the open price's values (a
    correction). `batch_discount` is the fraction taken off batch requests (0..1).
    """
    model = _check_model(model)
    values = {
        "input_per_mtok": to_decimal("input_per_mtok", input_per_mtok),
        "cached_input_per_mtok": to_decimal("cached_input_per_mtok", cached_input_per_mtok),
        "output_per_mtok": to_decimal("output_per_mtok", output_per_mtok),
        "batch_discount": to_decimal("batch_discount", batch_discount, DISCOUNT_SCALE),
    }
    if values["batch_discount"] > 1:
        raise InvalidPriceError(f"batch_discount must be a fraction between 0 and 1, got {batch_discount}",
                                field="batch_discount")
    if effective_from is not None and (not isinstance(effective_from, datetime) or effective_from.tzinfo is None):
        raise InvalidPriceError("effective_from must be a timezone-aware datetime (UTC)", field="effective_from")
    start = (effective_from or utcnow()).astimezone(UTC)
    current = open_price(session, model)
    if current is not None:
        if start < current.effective_from:
            raise InvalidPriceError(
                f"the current price of {model!r} starts {current.effective_from.isoformat()}; "
                f"a new price must not start earlier ({start.isoformat()})", field="effective_from")
        if start == current.effective_from:
            for field, value in values.items():
                setattr(current, field, value)
            session.flush()
            return current
        current.effective_to = start
    price = Price(model=model, effective_from=start, effective_to=None, **values)
    session.add(price)
    session.flush()
    return price


def list_prices(session: Session, model: str | None = None) -> list[Price]:
    """Every price (of one model if given), by model then start."""
    query = select(Price).order_by(Price.model, Price.effective_from)
    if model is not None:
        query = query.where(Price.model == model)
    return list(session.scalars(query))


def price_at(session: Session, model: str, when: datetime) -> Price | None:
    """The price of `model` in effect at `when` (aware), or None when it had none."""
    if when.tzinfo is None:
        raise InvalidPriceError("when must be a timezone-aware datetime (UTC)")
    return session.scalar(
        select(Price).where(Price.model == model, Price.effective_from <= when,
                            or_(Price.effective_to.is_(None), Price.effective_to > when))
        .order_by(Price.effective_from.desc()).limit(1))


def decimal_text(value: Decimal | None) -> str | None:
    """A Decimal as a plain string without exponent or trailing zeros ("1.5", "0", "1200")."""
    if value is None:
        return None
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def price_to_dict(price: Price) -> dict[str, Any]:
    """A price as JSON-ready data: decimals as strings, times as ISO 8601 (effective_to None = open)."""
    return {
        "id": price.id, "model": price.model,
        "input_per_mtok": decimal_text(price.input_per_mtok),
        "cached_input_per_mtok": decimal_text(price.cached_input_per_mtok),
        "output_per_mtok": decimal_text(price.output_per_mtok),
        "batch_discount": decimal_text(price.batch_discount),
        "effective_from": _iso(price.effective_from), "effective_to": _iso(price.effective_to),
    }
