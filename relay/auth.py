"""Connection handshake: the relay greets with a nonce; with a run token both sides prove they hold it.

    relay  -> client  {"op": "hello", "proto", "relay_id", "nonce": hex, "auth": bool}
    client -> relay   {"op": "auth", "nonce": hex, "mac": HMAC-SHA256(token, "client" | relay nonce | client nonce)}
    relay  -> client  {"ok": true, "mac": HMAC-SHA256(token, "relay" | client nonce | relay nonce)}
                      or {"ok": false, "error"} and the connection is closed

The token never crosses the wire, a recorded answer is useless against a fresh nonce, and the client
checks the relay's answer too, so a stray client can neither push nor read weights and a stray relay
cannot pose as one of the run. With token=None on the relay the hello says auth=false and requests
follow at once; a client holding a token refuses such a relay (it cannot be one of the run).

After a successful handshake both sides authenticate every later frame and payload byte
(protocol.Session, set on the socket here):

    frame key  HMAC-SHA256(token, "frames" | relay nonce | client nonce)   per connection
    data key   HMAC-SHA256(token, "data")                                    per run

so the handshake is not the only check: a peer in the middle that alters a chunk of weights, or replays,
drops or reorders frames, fails the receiver's MAC check and the version is not used.

A relay without a token accepts any peer that can reach it, so off loopback it refuses to start
(laminar.listeners.check_bind) unless LAMINAR_INSECURE=1 accepts RELAY_RISK by name.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

from laminar.errors import RelayError
from laminar.relay import protocol

NONCE_BYTES = 16
TOKEN_HINT = "check that LAMINAR_RELAY_TOKEN is the same run token on the trainer, relays and rollouts"
RELAY_RISK = "anyone who can reach the port can push weights into a run or read them"
CLIENT_SENDS, RELAY_SENDS = b"client>relay", b"relay>client"  # the direction each frame MAC is bound to


def session(token: str, relay_nonce: bytes, client_nonce: bytes, *, relay_side: bool) -> protocol.Session:
    """The connection's frame and data keys, derived from the run token and both handshake nonces."""
    key = token.encode()
    frame_key = hmac.new(key, b"frames|" + relay_nonce + b"|" + client_nonce, hashlib.sha256).digest()
    data_key = hmac.new(key, b"data", hashlib.sha256).digest()
    send, recv = (RELAY_SENDS, CLIENT_SENDS) if relay_side else (CLIENT_SENDS, RELAY_SENDS)
    return protocol.Session(frame_key, data_key, send_label=send, recv_label=recv)


def _mac(token: str, role: bytes, first: bytes, second: bytes) -> str:
    return hmac.new(token.encode(), role + b"|" + first + b"|" + second, hashlib.sha256).hexdigest()


def _nonce(value: object, who: str) -> bytes:
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != NONCE_BYTES:
        raise RelayError(f"handshake: {who} sent nonce {value!r}, expected {NONCE_BYTES} random bytes in hex")
    return raw


def serve_handshake(sock: socket.socket, relay_id: str, token: str | None) -> None:
    """Relay side: greet, and with a token require the client's proof; RelayError if it fails."""
    nonce = os.urandom(NONCE_BYTES)
    hello = {"op": protocol.OP_HELLO, "proto": protocol.PROTOCOL_VERSION, "relay_id": relay_id,
             "nonce": nonce.hex(), "auth": token is not None}
    protocol.send_frame(sock, hello)
    if token is None:
        return
    frame = protocol.recv_frame(sock, allow_eof=True)
    if frame is None:
        raise RelayError("client closed the connection during the handshake")
    header, _ = frame
    if header.get("op") != protocol.OP_AUTH:
        _refuse(sock, f"relay {relay_id} requires authentication before op {header.get('op')!r}; "
                      f"the client has no run token ({TOKEN_HINT})")
    client_nonce = _nonce(header.get("nonce"), "client")
    mac = header.get("mac")
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(token, b"client", nonce, client_nonce)):
        _refuse(sock, f"relay {relay_id}: authentication failed, wrong run token ({TOKEN_HINT})")
    protocol.send_frame(sock, {"ok": True, "mac": _mac(token, b"relay", client_nonce, nonce)})
    protocol.set_session(sock, session(token, nonce, client_nonce, relay_side=True))


def _refuse(sock: socket.socket, error: str) -> None:
    try:
        protocol.send_frame(sock, {"ok": False, "error": error})
    except RelayError:
        pass
    raise RelayError(error)


def client_handshake(sock: socket.socket, addr: str, token: str | None) -> dict:
    """Client side: read the hello, prove the token and check the relay's proof; returns the hello."""
    hello = protocol.recv_header(sock)
    assert hello is not None
    protocol.recv_payload(sock, hello)
    if hello.get("op") != protocol.OP_HELLO:
        raise RelayError(f"relay {addr} did not greet with a hello frame (got {hello.get('op')!r}); "
                         "it is not a laminar relay of this protocol version")
    if hello.get("proto") != protocol.PROTOCOL_VERSION:
        raise RelayError(f"relay {addr} speaks relay protocol {hello.get('proto')!r} and this client "
                         f"{protocol.PROTOCOL_VERSION}; run the same laminar version on the trainer, the relays and "
                         "the rollout hosts")
    wants_auth = bool(hello.get("auth"))
    if wants_auth and token is None:
        raise RelayError(f"relay {addr} requires a run token and this client has none; {TOKEN_HINT}")
    if not wants_auth:
        if token is not None:
            raise RelayError(f"relay {addr} does not authenticate, but this client holds a run token; the "
                             f"address may not be a relay of this run ({TOKEN_HINT})")
        return hello
    relay_nonce = _nonce(hello.get("nonce"), f"relay {addr}")
    nonce = os.urandom(NONCE_BYTES)
    protocol.send_frame(sock, {"op": protocol.OP_AUTH, "nonce": nonce.hex(),
                               "mac": _mac(token, b"client", relay_nonce, nonce)})
    frame = protocol.recv_frame(sock, allow_eof=True)
    if frame is None:
        raise RelayError(f"relay {addr} closed the connection during authentication; {TOKEN_HINT}")
    reply, _ = frame
    if not reply.get("ok"):
        raise RelayError(f"relay {addr} refused the connection: {reply.get('error', 'no error given')}")
    mac = reply.get("mac")
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(token, b"relay", nonce, relay_nonce)):
        raise RelayError(f"relay {addr} could not prove it holds the run token; {TOKEN_HINT}")
    protocol.set_session(sock, session(token, relay_nonce, nonce, relay_side=False))
    return hello
