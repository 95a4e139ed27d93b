"""`eagle3 doctor`: catch the zero-acceptance misconfigurations before they cost days (cli.py: the
command; offline.py: a draft and its target; launch.py: launch lines; server.py: a running server)."""
from .catalog import CATALOG
from .cli import doctor_main
from .launch import DraftFacts, TargetFacts, lint_launch
from .offline import ProbeSettings, run_doctor
from .report import Check, DoctorReport
from .server import ServerSettings, run_server_doctor

__all__ = ["CATALOG", "Check", "DoctorReport", "DraftFacts", "ProbeSettings", "ServerSettings", "TargetFacts",
           "doctor_main", "lint_launch", "run_doctor", "run_server_doctor"]
