from django.urls import path

from endpoints.bench import fragments, views

urlpatterns = [
    path("benchmarks/", views.bench_list, name="bench_list"),
    path("benchmarks/compare", views.bench_compare, name="bench_compare"),
    path("benchmarks/compare.csv", views.bench_compare_csv, name="bench_compare_csv"),
    path("benchmarks/compare.json", views.bench_compare_json, name="bench_compare_json"),
    path("benchmarks/<int:run_id>/", views.bench_detail, name="bench_detail"),
    path("benchmarks/<int:run_id>/status", views.bench_status, name="bench_status"),
    path("benchmarks/<int:run_id>/result.json", views.bench_result_json, name="bench_result_json"),
    path("benchmarks/<int:run_id>/cancel", views.bench_cancel, name="bench_cancel"),
    path("benchmarks/sweeps/<int:sweep_id>/", views.bench_sweep_detail, name="bench_sweep_detail"),
    path("benchmarks/sweeps/<int:sweep_id>/cancel", views.bench_sweep_cancel, name="bench_sweep_cancel"),
    path("artifacts/<int:artifact_id>/speed", fragments.artifact_speed, name="artifact_speed"),
]
