"""Profile pages: watch one (started from the endpoint page, endpoints.views.endpoint_profile_new), read its
breakdown and advice, download the trace, compare two or more side by side."""

import mimetypes
import tempfile
import zipfile
from pathlib import Path

from django.contrib import messages
from django.http import FileResponse, Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from console.exceptions import Conflict
from console.roles import OPERATOR, VIEWER, require_role
from endpoints.bench.compare import plotly_text
from endpoints.bench.selectors import parse_ids
from endpoints.bench.snapshots import telemetry_summary
from endpoints.profiling import selectors, services, storage
from endpoints.profiling.forms import CompareWithForm
from endpoints.profiling.models import Profile


def _profile(request, profile_id: int, role: str) -> Profile:
    return selectors.profile_get(profile_id, user=request.user, role=role)


@require_role(VIEWER)
@require_GET
def profile_detail(request, profile_id: int):
    profile = _profile(request, profile_id, VIEWER)
    same, elsewhere = (
        selectors.comparable_profiles(profile, user=request.user) if profile.state == "succeeded" else ([], [])
    )
    return render(
        request,
        "profiling/profile_detail.html",
        {
            "profile": profile,
            "compare_form": CompareWithForm(profile=profile, same=same, elsewhere=elsewhere)
            if same or elsewhere
            else None,
            "telemetry_rows": telemetry_summary(profile.telemetry),
            "chart": {"profiles": [_chart_data(profile)]},
        },
    )


def _chart_data(profile: Profile) -> dict:
    return {
        "id": profile.pk,
        "setup": plotly_text(profile.title),  # a Plotly trace name: no tags of the label rendered
        "breakdown": profile.breakdown or [],
        "telemetry": profile.telemetry or {},
    }


@require_role(VIEWER)
@require_GET
def profile_status(request, profile_id: int):
    """The live part of a profile's page, polled by htmx; the page reloads when it ends."""
    profile = _profile(request, profile_id, VIEWER)
    response = render(request, "profiling/_profile_status.html", {"profile": profile})
    if not profile.is_active and request.GET.get("was") == "active":
        response["HX-Refresh"] = "true"
    return response


@require_role(VIEWER)
@require_GET
def profile_file(request, profile_id: int, name: str):
    """One trace file, as vLLM wrote it (Perfetto and chrome://tracing open the .pt.trace.json.gz;
    MindStudio Insight the Ascend profiler's directory)."""
    profile = _profile(request, profile_id, VIEWER)
    if name not in {f["name"] for f in profile.files}:
        raise Http404("No such file in this profile.")
    root = storage.profile_dir(profile.pk).resolve()
    path = (root / name).resolve()
    if root not in path.parents or not path.is_file():  # the listed names only, inside the profile's directory
        raise Http404("No such file in this profile.")
    content_type = (
        "application/gzip" if name.endswith(".gz") else (mimetypes.guess_type(name)[0] or "application/octet-stream")
    )
    return FileResponse(
        open(path, "rb"),
        as_attachment=True,
        filename=f"profile-{profile.pk}-{Path(name).name}",
        content_type=content_type,
    )


@require_role(VIEWER)
@require_GET
def profile_archive(request, profile_id: int):
    """Every file of the profile in one .zip (an Ascend profile is a directory tree: MindStudio
    Insight opens the unpacked *_ascend_pt folder)."""
    profile = _profile(request, profile_id, VIEWER)
    root = storage.profile_dir(profile.pk)
    if not profile.files or not root.is_dir():
        raise Http404("This profile has no files.")
    archive = tempfile.TemporaryFile()  # noqa: SIM115 (FileResponse closes it)
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as bundle:
        for entry in profile.files:  # the recorded names only, each checked to stay inside the profile
            path = (root / entry["name"]).resolve()
            if root.resolve() in path.parents and path.is_file():
                # gzip traces are already compressed: stored as they are
                bundle.write(
                    path, entry["name"], zipfile.ZIP_STORED if entry["name"].endswith(".gz") else zipfile.ZIP_DEFLATED
                )
    archive.seek(0)
    return FileResponse(
        archive, as_attachment=True, filename=f"profile-{profile.pk}.zip", content_type="application/zip"
    )


@require_role(OPERATOR)
@require_POST
def profile_delete(request, profile_id: int):
    profile = _profile(request, profile_id, OPERATOR)
    endpoint = profile.endpoint
    try:
        services.profile_delete(profile=profile, user=request.user, request=request)
    except Conflict as exc:
        messages.error(request, exc.message)
        return redirect(profile)
    messages.success(request, f"Profile #{profile_id} deleted with its trace files.")
    return redirect(endpoint) if endpoint else redirect("endpoint_list")


@require_role(VIEWER)
@require_GET
def profile_compare(request):
    """Two or more profiles side by side: the breakdown by category and each one's top operators."""
    profiles = [
        p
        for p in selectors.profiles_by_ids(parse_ids(request.GET.getlist("ids")), user=request.user)
        if p.state == "succeeded"
    ]
    categories = []
    for p in profiles:
        for row in p.breakdown or []:
            if row["category"] not in categories:
                categories.append(row["category"])
    table = [
        {
            "category": c,
            "shares": [next((r["share"] for r in p.breakdown if r["category"] == c), None) for p in profiles],
        }
        for c in categories
    ]
    return render(
        request,
        "profiling/compare.html",
        {
            "profiles": profiles,
            "table": table,
            "chart": {"profiles": [_chart_data(p) for p in profiles]},
        },
    )
