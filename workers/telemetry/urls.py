from django.urls import path

from workers.telemetry import views

urlpatterns = [
    path("telemetry/fleet", views.fleet_panel, name="telemetry_fleet"),
    path("telemetry/overview-nodes", views.overview_nodes, name="telemetry_overview_nodes"),
    path("nodes/<int:node_id>/telemetry", views.node_panel, name="telemetry_node_panel"),
    path("alerts/", views.alert_list, name="alert_list"),
    path("alerts/rules/create", views.alert_rule_create, name="alert_rule_create"),
    path("alerts/rules/<int:rule_id>/update", views.alert_rule_update, name="alert_rule_update"),
    path("metrics", views.metrics_exposition, name="metrics"),
]
