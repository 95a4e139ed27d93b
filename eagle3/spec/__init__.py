"""Speculative decoding: drafts, checkpoint formats, the contract, trees, verification, the decoder."""
from .contract import check_pair, run_checks
from .draft import DraftBase, DraftConfig, DraftOutput, Eagle1Draft, Eagle3Draft, build_draft
from .engine import SpecDecoder
from .formats import LoadedDraft, load_draft, save_draft
from .monitor import AcceptanceMonitor
from .tree import SpecParams

__all__ = ["check_pair", "run_checks", "DraftBase", "DraftConfig", "DraftOutput", "Eagle1Draft",
           "Eagle3Draft", "build_draft", "SpecDecoder", "LoadedDraft", "load_draft", "save_draft",
           "AcceptanceMonitor", "SpecParams"]
