"""The console's RQ worker class: `manage.py jobs_worker` runs it, and the convert and quantize workers name it
(`rqworker convert quantize --worker-class workers.jobs.worker.JobWorker`: deploy/)."""

import logging
from datetime import timedelta

from django.db import DatabaseError, connections
from rq import Worker
from rq.utils import now

from workers.jobs.context import remove_this_hosts_staging

log = logging.getLogger(__name__)


class JobWorker(Worker):
    """SIGTERM (or SIGINT) stops the running job with the worker: RQ's cold shutdown, which kills the job's
    process group and so its children (workers.jobs.children), instead of RQ's warm shutdown, which waits
    for the job to end. A supervisor waits seconds, not hours: supervisord's stopwaitsecs, systemd's
    TimeoutStopSec, Kubernetes' grace period, then it kills the worker alone, and the work horse (its own
    process group: rq 2.12 worker_classes.py ``os.setpgrp()``) ran on unseen after the console stopped. The
    reaper marks the job failed (no heartbeat) and removes its staging directory; Retry runs it again."""

    def request_stop(self, signum, frame):
        self._shutdown_requested_date = now() - timedelta(seconds=2)  # not "a second signal within 1 s"
        self.request_force_stop(signum, frame)

    def run_maintenance_tasks(self):
        """RQ's own (at start, then every 10 minutes), then the staging directories this host's killed jobs left."""
        super().run_maintenance_tasks()
        try:
            removed = remove_this_hosts_staging()
        except (DatabaseError, OSError) as exc:  # maintenance must not end the worker: next time
            log.warning("staging directories of this host's ended jobs not removed: %s", exc)
        else:
            if removed:
                log.warning(
                    "removed %d staging director%s of this host's ended jobs", removed, "y" if removed == 1 else "ies"
                )
        finally:
            connections.close_all()  # RQ forks each job from this process: it must not inherit a connection
