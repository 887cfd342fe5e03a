from django.urls import path

from evaluations import views

urlpatterns = [
    path("evaluations/", views.evaluation_list, name="evaluation_list"),
    path("evaluations/new", views.evaluation_new, name="evaluation_new"),
    path("evaluations/tasks/upload", views.task_upload, name="evaluation_task_upload"),
    path("evaluations/compare", views.evaluation_compare, name="evaluation_compare"),
    path("evaluations/<int:evaluation_id>/", views.evaluation_detail, name="evaluation_detail"),
    path("evaluations/<int:evaluation_id>/samples.jsonl", views.evaluation_samples, name="evaluation_samples"),
]
