#!/usr/bin/env python3
"""The image's health probe: exit 0 when the gateway's /health answers 200 (every pool has a ready
engine), 1 otherwise, printing the gateway's reason. Standard library only.

    deepinfer-healthcheck [URL]      (default: http://127.0.0.1:8000/health)
"""

import json
import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    url = argv[1] if len(argv) > 1 else "http://127.0.0.1:8000/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return 0 if reply.status == 200 else 1
    except urllib.error.HTTPError as e:  # 503 while a pool has no ready engine: say why
        try:
            print(json.loads(e.read()).get("detail", ""), file=sys.stderr)
        except ValueError:
            pass
        return 1
    except OSError as e:
        print(f"{url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
