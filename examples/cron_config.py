"""Cron-driven inference: an rq cron config that fires a generation every hour.

Run it with the JSON-serializing scheduler (rq 3.0's ``rq cron`` pickles jobs; see
docs/client.md, "Cron-driven inference") and an rq worker that reads JSON only::

    python -m tokenfleet.producer.cron examples/cron_config.py --url redis://redis:6379/0
    rq worker -S json --url redis://redis:6379/0 tokenfleet-cron

``on_overload="skip"`` gives ``try_submit`` semantics: when the batch queue is full the firing
is skipped (the job returns ``{"status": "skipped"}``) instead of piling up behind itself.
``deadline_s`` makes a firing that waited too long end ``expired`` rather than run late.
"""

from rq import cron

from tokenfleet.producer.jobs import generate

cron.register(
    generate,
    queue_name="tokenfleet-cron",
    kwargs={
        "prompt": "Write a one-line status summary for the hourly report.",
        "max_tokens": 64,
        "temperature": 0.0,
        "priority": "batch",
        "deadline_s": 600,
        "on_overload": "skip",
        "result_timeout": 900,
    },
    interval=3600,
    name="hourly-summary",
)
