"""Export a draft to other engines' layouts and print their launch lines."""
from .writer import ExportResult, export_draft, launch_lines

__all__ = ["ExportResult", "export_draft", "launch_lines"]
