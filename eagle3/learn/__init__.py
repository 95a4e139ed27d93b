"""Learning from served traffic: capture of finished requests, the learner process, the gate, draft
versions, and the swap and rollback decisions. The server calls it; it never imports the server."""
from .capture import TrafficCapture
from .controller import LearnController, LearnOptions
from .identity import target_identity

__all__ = ["LearnController", "LearnOptions", "TrafficCapture", "target_identity"]
