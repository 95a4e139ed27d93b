"""The draft: EAGLE-3 / EAGLE-1/2 modules, their checkpoint formats and the target/draft contract."""
from .contract import check_pair, run_checks
from .formats import LoadedDraft, load_draft, save_draft
from .model import DraftBase, DraftConfig, DraftOutput, Eagle1Draft, Eagle3Draft, build_draft

__all__ = ["check_pair", "run_checks", "LoadedDraft", "load_draft", "save_draft", "DraftBase",
           "DraftConfig", "DraftOutput", "Eagle1Draft", "Eagle3Draft", "build_draft"]
