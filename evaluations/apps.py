from django.apps import AppConfig


class EvaluationsConfig(AppConfig):
    name = "evaluations"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # Defining the job kind registers it with the job runtime (workers.jobs); the gates answer the hooks of
        # the layers below (the registry's quantize job, the gateway's rollout controller), which never import
        # evaluations.
        from evaluations import gates, jobs  # noqa: F401

        gates.register()
