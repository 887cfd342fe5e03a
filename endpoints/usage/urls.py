from django.urls import path

from endpoints.usage import views

urlpatterns = [
    path("usage/", views.usage_page, name="usage"),
    path("usage/teams/<int:team_id>/budgets", views.team_budget_set, name="team_budget_set"),
    path("usage/teams/<int:team_id>/budgets/<str:period>/delete", views.team_budget_delete, name="team_budget_delete"),
    path("gateway/keys/<int:key_id>/budgets", views.key_budgets, name="key_budgets"),
    path("gateway/keys/<int:key_id>/budgets/set", views.key_budget_set, name="key_budget_set"),
    path("gateway/keys/<int:key_id>/budgets/<str:period>/delete", views.key_budget_delete, name="key_budget_delete"),
]
