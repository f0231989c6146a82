"""Replaces itself with a program that is not Python (os.execl)."""

import os

os.execl("/bin/true", "true")
