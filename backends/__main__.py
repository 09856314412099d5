"""``python -m backends``: every backend per device present, available or why not, and what auto picks."""
from . import report

if __name__ == "__main__":
    print(report())
