"""Pod Security admission, as the API server's PodSecurity plugin enforces it at pod CREATE.

A namespace labelled ``pod-security.kubernetes.io/enforce: baseline`` or ``restricted`` gets its
pods checked against that level of the Pod Security Standards (kubernetes.io/docs/concepts/
security/pod-security-standards, "latest" as of Kubernetes 1.30); a violating pod is refused
with 403 and the plugin's wording (``violates PodSecurity "restricted:latest": ...``). Checked
after the mutating webhooks, as the real plugin runs among the validating admission plugins.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

LABEL = "pod-security.kubernetes.io/enforce"
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID",
                         "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}


def _containers(spec: Dict[str, Any]) -> Iterator[Tuple[str, Dict[str, Any]]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for container in spec.get(kind) or []:
            yield str(container.get("name")), container


def _context(obj: Dict[str, Any]) -> Dict[str, Any]:
    return obj.get("securityContext") or {}


def _baseline(spec: Dict[str, Any]) -> List[str]:
    out: List[str] = []
    pod = _context(spec)
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"host namespaces ({field}=true)")
    if (pod.get("windowsOptions") or {}).get("hostProcess"):
        out.append("hostProcess")
    for volume in spec.get("volumes") or []:
        if "hostPath" in volume:
            out.append(f'hostPath volumes (volume "{volume.get("name")}")')
    if (pod.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append("seccompProfile (pod must not set securityContext.seccompProfile.type to "
                   "\"Unconfined\")")
    if (pod.get("seLinuxOptions") or {}).get("type", "") not in SELINUX_TYPES:
        out.append("seLinuxOptions")
    for sysctl in pod.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"forbidden sysctls ({sysctl.get('name')})")
    for name, container in _containers(spec):
        context = _context(container)
        if context.get("privileged"):
            out.append(f'privileged (container "{name}" must not set '
                       f"securityContext.privileged=true)")
        added = set((context.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            out.append(f'non-default capabilities (container "{name}" must not include '
                       f"{sorted(added - BASELINE_CAPABILITIES)})")
        if any(p.get("hostPort") for p in container.get("ports") or []):
            out.append(f'hostPort (container "{name}")')
        if context.get("procMount", "Default") != "Default":
            out.append(f'procMount (container "{name}")')
        if (context.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f'seccompProfile (container "{name}" must not set it to "Unconfined")')
        if (context.get("seLinuxOptions") or {}).get("type", "") not in SELINUX_TYPES:
            out.append(f'seLinuxOptions (container "{name}")')
    return out


def _restricted(spec: Dict[str, Any]) -> List[str]:
    out = _baseline(spec)
    pod = _context(spec)
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f'restricted volume types (volume "{volume.get("name")}" uses '
                       f"{sorted(kinds - RESTRICTED_VOLUMES)})")
    pod_non_root = pod.get("runAsNonRoot") is True
    pod_seccomp = (pod.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    if pod.get("runAsUser") == 0:
        out.append("runAsUser=0 (pod must not set runAsUser=0)")
    for name, container in _containers(spec):
        context = _context(container)
        if context.get("allowPrivilegeEscalation") is not False:
            out.append(f'allowPrivilegeEscalation != false (container "{name}" must set '
                       f"securityContext.allowPrivilegeEscalation=false)")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            out.append(f'unrestricted capabilities (container "{name}" must set '
                       f'securityContext.capabilities.drop=["ALL"])')
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f'unrestricted capabilities (container "{name}" must not add '
                       f"capabilities other than NET_BIND_SERVICE)")
        non_root = context.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            out.append(f'runAsNonRoot != true (container "{name}" must set '
                       f"securityContext.runAsNonRoot=true)")
        if context.get("runAsUser") == 0:
            out.append(f'runAsUser=0 (container "{name}" must not set runAsUser=0)')
        seccomp = (context.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost") and not (seccomp is None and pod_seccomp):
            out.append(f'seccompProfile (container "{name}" must set '
                       f'securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost")')
    return out


def violations(level: Optional[str], pod: Dict[str, Any]) -> List[str]:
    """What a pod does that the namespace's enforced level forbids (empty: admitted)."""
    spec = pod.get("spec") or {}
    if level == "restricted":
        return _restricted(spec)
    if level == "baseline":
        return _baseline(spec)
    return []
