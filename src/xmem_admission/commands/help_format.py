"""The help layout of the long-running commands (``serve``, ``controller``): every option with a
default says it, as ``(default: ...)`` after its help.

Flags without a value (``--no-hold``) and options without a default say nothing: "default: True"
on a switch reads as the opposite of what it means.
"""

from __future__ import annotations

import argparse


class DefaultsShown(argparse.HelpFormatter):
    """``argparse.ArgumentDefaultsHelpFormatter`` without the switches and the unset options."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" in text or action.default in (None, "", argparse.SUPPRESS)
                or action.nargs == 0 or not action.option_strings):
            return text
        # The environment variable stays last: "address to listen on (default: 0.0.0.0) [XMEM_HOST]".
        if text.rstrip().endswith("]") and "[" in text:
            head, env = text[:text.rindex("[")].rstrip(), text[text.rindex("["):]
            return f"{head} (default: %(default)s) {env}".lstrip()
        return f"{text} (default: %(default)s)".lstrip()
