from django.apps import AppConfig


class EndpointsConfig(AppConfig):
    name = "endpoints"
    default_auto_field = "django.db.models.BigAutoField"
