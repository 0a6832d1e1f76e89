"""The layer every other one stands on (issue 54): it imports nothing else of nagmoe.

  errors.py       UserError (one line, exit 2), `shown` (a bounded repr for messages), `warn`
  files.py        the one writer (nothing written through a planted name) and the one reader (files someone else
                  may have written: UTF-8, bounded parsing, typed fields)
  environment.py  every variable a job reads from its environment: NAGMOE_* machine settings, Slurm's and
                  torchrun's, validated at start
"""
