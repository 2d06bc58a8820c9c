from moescope.cli import entry

entry()
