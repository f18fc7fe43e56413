"""Where the repository is, for tests that read its files or launch its scripts."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
