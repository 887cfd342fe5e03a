"""supervisord event listener (deploy/supervisord.conf, [eventlistener:echo]): print each console process's
output on stderr, line by line, prefixed with the process's name, as honcho did in the terminal. supervisord
sends the output as PROCESS_LOG events; the protocol (supervisor.childutils) runs over this process's
stdin/stdout, and supervisord sends stderr to its own terminal. Hand-written: supervisor ships no such
listener, and the one on PyPI (supervisor-stdout 0.1.1) is Python 2 code."""

import sys

from supervisor import childutils


def main() -> None:
    # supervisord counts the payload's length in characters of UTF-8-decoded text.
    sys.stdin.reconfigure(encoding="utf-8", errors="replace")
    sys.stdout.reconfigure(encoding="utf-8")
    sys.stderr.reconfigure(encoding="utf-8", errors="replace")
    partial: dict[str, str] = {}  # a process's line not yet ended: events carry chunks, not lines
    width = 10
    while True:
        headers, payload = childutils.listener.wait(sys.stdin, sys.stdout)
        if headers["eventname"].startswith("PROCESS_LOG"):
            fields, data = childutils.eventdata(payload)
            name = fields["processname"]
            width = max(width, len(name))
            *lines, partial[name] = (partial.get(name, "") + data).split("\n")
            for line in lines:
                sys.stderr.write(f"{name:<{width}} | {line}\n")
            sys.stderr.flush()
        childutils.listener.ok(sys.stdout)


if __name__ == "__main__":
    main()
