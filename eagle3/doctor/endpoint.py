"""A running server seen from outside: HTTP on the standard library, Prometheus text, which engine
answers, and its speculation counters. What each engine exposes where is `engines.LIVE`; nothing
here spells out an engine's metric or route.

Every failure to talk to the server is a `ServerError` carrying the check it fails, what happened
and the fix: unreachable, timed out, refused the key, answered something that is not JSON (a web
page, a proxy), or metrics that do not parse.
"""
from __future__ import annotations

import json
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Optional

from ..engines import LIVE, LiveFacts
from ..errors import Eagle3Error, InputError


class ServerError(Eagle3Error):
    """A server that cannot be read: `check` is the doctor check it fails, `fix` what to do."""

    def __init__(self, check: str, message: str, fix: str):
        self.check, self.message, self.fix = check, message, fix
        super().__init__(f"{message}. Fix: {fix}")


@dataclass(frozen=True)
class Reply:
    status: int
    content_type: str
    body: bytes
    seconds: float


# ---------------------------------------------------------------------------- HTTP
class Endpoint:
    """GET/POST against one base URL with an optional bearer key and a per-request timeout."""

    def __init__(self, url: str, api_key: Optional[str] = None, timeout_s: float = 60.0):
        self.url = base_url(url)
        self.api_key, self.timeout_s = api_key, timeout_s

    def request(self, path: str, body: Optional[dict] = None) -> Reply:
        """The reply, whatever its status; ServerError when there is none (refused, timed out)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return Reply(resp.status, resp.headers.get("Content-Type", ""), resp.read(),
                             time.perf_counter() - start)
        except urllib.error.HTTPError as e:
            return Reply(e.code, e.headers.get("Content-Type", "") if e.headers else "", e.read(),
                         time.perf_counter() - start)
        except (socket.timeout, TimeoutError):
            raise self._timeout(path) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (socket.timeout, TimeoutError)):
                raise self._timeout(path) from None
            raise ServerError("server.reach", f"cannot connect to {self.url} ({e.reason})",
                              "check the host and port and that the server is running "
                              f"(curl {self.url}/v1/models)") from None
        except (ConnectionError, OSError) as e:   # reset mid-reply
            raise ServerError("server.reach", f"{self.url}{path}: the connection failed ({e})",
                              "check the server's log: it may have crashed") from None

    def _timeout(self, path: str) -> ServerError:
        return ServerError("server.timeout", f"{self.url}{path} gave no answer within "
                           f"{self.timeout_s:g} s", "raise --timeout (a loaded server or a long "
                           "generation), or check the server's log: it may be stuck")

    def json(self, path: str, body: Optional[dict] = None, optional: bool = False) -> Any:
        """The JSON a route answers. optional: None for 404/405 or a reply that is not JSON."""
        reply = self.request(path, body)
        if reply.status in (401, 403):
            raise auth_error(self.url + path, reply, self.api_key)
        if optional and (reply.status in (404, 405) or not is_json(reply)):
            return None
        if reply.status != 200:
            raise ServerError("server.api", f"{'POST' if body else 'GET'} {self.url}{path} "
                              f"answered {reply.status}: {snippet(reply.body)}",
                              "see the message; the server's log has the details")
        if not is_json(reply):
            raise ServerError("server.api", f"GET {self.url}{path} answered "
                              f"{reply.content_type or 'no content type'} ({snippet(reply.body)}), "
                              "not JSON: this is not an OpenAI-compatible API",
                              "point --server at the engine's own base URL (http://HOST:PORT, "
                              "without /v1), not a web page, proxy or UI in front of it")
        return json.loads(reply.body)

    def text(self, path: str) -> Optional[str]:
        """A text route (/metrics); None where the server has no such route."""
        reply = self.request(path)
        if reply.status in (401, 403):
            raise auth_error(self.url + path, reply, self.api_key)
        if reply.status in (404, 405):
            return None
        if reply.status != 200:
            raise ServerError("server.metrics", f"GET {self.url}{path} answered {reply.status}: "
                              f"{snippet(reply.body)}", "see the server's log")
        return reply.body.decode("utf-8", errors="replace")


def base_url(url: str) -> str:
    """http(s)://host:port[/prefix] without a trailing slash or /v1; InputError otherwise."""
    parsed = urllib.parse.urlparse(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise InputError(f"--server {url!r}: expected http://HOST:PORT (the engine's base URL)")
    path = parsed.path.rstrip("/")
    path = path[:-3] if path.endswith("/v1") else path
    return f"{parsed.scheme}://{parsed.netloc}{path}"


def is_json(reply: Reply) -> bool:
    if "json" not in reply.content_type.lower():
        return False
    try:
        json.loads(reply.body)
    except ValueError:
        return False
    return True


def snippet(body: bytes, n: int = 80) -> str:
    text = " ".join(body.decode("utf-8", errors="replace").split())
    return repr(text[:n] + ("..." if len(text) > n else ""))


def auth_error(where: str, reply: Reply, key: Optional[str]) -> ServerError:
    if key:
        return ServerError("server.auth", f"{where} refused the API key ({reply.status})",
                           "pass the key the server was started with (--api-key KEY)")
    return ServerError("server.auth", f"{where} answered {reply.status}: the server needs an API key",
                       "pass --api-key KEY (sent as 'Authorization: Bearer KEY')")


# ---------------------------------------------------------------------------- Prometheus text
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')


@dataclass(frozen=True)
class MetricSample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


def parse_metrics(text: str, where: str = "/metrics") -> list[MetricSample]:
    """Every sample of a Prometheus text exposition; ServerError naming the first bad line."""
    samples = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        labels = parse_labels(m.group(2) or "") if m else None
        value = to_float(m.group(3)) if m else None
        if labels is None or value is None:
            raise ServerError("server.metrics", f"{where} line {n} is not Prometheus text: "
                              f"{line[:100]!r}", "check that the URL is the engine itself; if the "
                              "engine's format changed, report it with this line (the names the "
                              "doctor reads are in eagle3/engines.py, LIVE)")
        samples.append(MetricSample(m.group(1), labels, value))
    return samples


def parse_labels(text: str) -> Optional[tuple[tuple[str, str], ...]]:
    out, pos = [], 0
    while pos < len(text.rstrip()):
        m = LABEL.match(text, pos)
        if m is None:
            return None
        out.append((m.group(1), m.group(2).replace('\\"', '"').replace("\\n", "\n")
                    .replace("\\\\", "\\")))
        pos = m.end()
    return tuple(out)


def to_float(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def total(samples: list[MetricSample], family: Optional[str]) -> Optional[float]:
    """A counter family summed over its label sets (engines, models); None when absent."""
    if family is None:
        return None
    found = [s.value for s in samples if s.name in (family, family + "_total")]
    return sum(found) if found else None


def mean(samples: list[MetricSample], family: Optional[str]) -> Optional[float]:
    """A gauge family averaged over its label sets (ranks); None when absent."""
    found = [s.value for s in samples if s.name == family] if family else []
    return sum(found) / len(found) if found else None


def by_position(samples: list[MetricSample], family: Optional[str], first: int) -> dict[int, float]:
    """{k: steps accepting >= k draft tokens} (k from 1) from a counter labelled `position`."""
    out: dict[int, float] = {}
    if family is None:
        return out
    for s in samples:
        pos = dict(s.labels).get("position")
        if s.name in (family, family + "_total") and pos is not None:
            if not pos.lstrip("-").isdigit():
                raise ServerError("server.metrics", f"{family}: position label {pos!r} is not an "
                                  "integer", "report the engine version with this line")
            k = int(pos) - first + 1
            if k < 1:
                raise ServerError("server.metrics", f"{family}: position {pos} is below the first "
                                  f"draft position this engine numbers ({first})", "report the "
                                  "engine version: engines.LIVE has its first position wrong")
            out[k] = out.get(k, 0.0) + s.value
    return out


# ---------------------------------------------------------------------------- identity and counters
@dataclass
class ServerInfo:
    """What the server says it is."""
    engine: Optional[LiveFacts]            # None: an OpenAI-compatible server of no known engine
    models: list[str]
    info: dict[str, Any] = field(default_factory=dict)     # the engine's info JSON
    info_route: Optional[str] = None                       # where it was read
    version: Optional[str] = None
    has_metrics: bool = False

    @property
    def settings(self) -> dict[str, Any]:
        return {k: self.info.get(k) for k in (self.engine.settings if self.engine else ())}

    @property
    def label(self) -> str:
        name = self.engine.label if self.engine else "an OpenAI-compatible server"
        return name + (f" {self.version}" if self.version else "")


def list_models(ep: Endpoint) -> list[str]:
    """The ids GET /v1/models lists: the one route every OpenAI-compatible engine answers."""
    body = ep.json("/v1/models")
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and "id" in m for m in data):
        raise ServerError("server.api", f"GET {ep.url}/v1/models answered {snippet(json.dumps(body).encode())}"
                          ", not an OpenAI model list ({\"data\": [{\"id\": ...}]})",
                          "point --server at an OpenAI-compatible server's base URL")
    return [str(m["id"]) for m in data]


def identify(ep: Endpoint) -> ServerInfo:
    models = list_models(ep)
    for facts in LIVE.values():
        for route, key in facts.detect:
            body = ep.json(route, optional=True)
            if isinstance(body, dict) and key in body:
                return describe(ep, facts, models)
    return ServerInfo(None, models, has_metrics=ep.text("/metrics") is not None)


def describe(ep: Endpoint, facts: LiveFacts, models: list[str]) -> ServerInfo:
    for route in facts.info_routes:
        info = ep.json(route, optional=True)
        if isinstance(info, dict):
            break
    else:
        info, route = {}, None
    version = info.get(facts.version_key) if facts.version_key else None
    return ServerInfo(facts, models, info, route, None if version is None else str(version),
                      has_metrics=ep.text("/metrics") is not None)


@dataclass(frozen=True)
class Counters:
    """A server's speculation totals at one moment (None: the server does not export it)."""
    drafts: Optional[float] = None
    draft_tokens: Optional[float] = None
    accepted: Optional[float] = None
    per_position: dict[int, float] = field(default_factory=dict)
    accept_length: Optional[float] = None        # a ratio engine's mean tokens per verify (since start)
    accept_length_recent: Optional[float] = None  # its recent-interval gauge
    draft_steps: Optional[float] = None          # steps verifying the draft's own proposals
    draft_accepted: Optional[float] = None       # accepted tokens the draft itself proposed

    @property
    def exported(self) -> bool:
        return any(v is not None for v in (self.drafts, self.accepted, self.accept_length,
                                            self.accept_length_recent))


def read_counters(ep: Endpoint, info: ServerInfo) -> Counters:
    facts = info.engine
    if facts is None:
        return Counters()
    samples = parse_metrics(ep.text("/metrics") or "", ep.url + "/metrics") if info.has_metrics else []
    length = None
    if facts.accept_length_key and info.info_route:
        length = mean_field(ep.json(info.info_route, optional=True) or {}, facts.accept_length_key)
    gauge = mean(samples, facts.accept_length_gauge)
    return Counters(total(samples, facts.drafts), total(samples, facts.draft_tokens),
                    total(samples, facts.accepted),
                    by_position(samples, facts.per_position, facts.first_position), length, gauge,
                    total(samples, facts.draft_steps), total(samples, facts.draft_accepted))


def mean_field(info: dict, key: str) -> Optional[float]:
    """`list.field` in an info JSON, averaged over the list (SGLang: one state per DP rank)."""
    outer, inner = key.split(".", 1)
    values = [s.get(inner) for s in info.get(outer) or [] if isinstance(s, dict)]
    values = [float(v) for v in values if isinstance(v, (int, float))]
    return sum(values) / len(values) if values else None


def settled_counters(ep: Endpoint, info: ServerInfo, tries: int = 5, wait_s: float = 0.2) -> Counters:
    """Counters read until two reads agree: an engine may publish a step's counts just after the
    reply (vLLM's front end records stats as it hands outputs on)."""
    last = read_counters(ep, info)
    for _ in range(tries):
        time.sleep(wait_s)
        now = read_counters(ep, info)
        if now == last:
            return now
        last = now
    return last
