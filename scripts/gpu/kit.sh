# The GPU kit's prefix (sourced by scripts/gpu/check; docs/gpu.md, "The GPU kit"): unpacks the Debian
# packages of gpu-kit/ into a prefix folder and sets up the environment that makes the relocated
# Open MPI, PMIx, HDF5, Boost.Test, toml++, CLI11, nlohmann-json and pkgconf work from there.
#   source scripts/gpu/kit.sh
#   kit_unpack KIT_DIR PREFIX      -> 0 when every package unpacked; says which tool it used
#                                     (KIT_EXTRACT_TOOL=dpkg-deb|ar|python forces one)
#   kit_env PREFIX [FIRST]         -> writes PREFIX/kit-bin (wrappers of mpirun, mpicc, pkgconf, ...),
#                                     exports PATH, OPAL_PREFIX, PMIx/Open MPI settings, PKG_CONFIG_*,
#                                     KIT_LD_PATH (the prefix's library folders) and KIT_BIN
#   kit_run COMMAND...             -> runs COMMAND with the prefix's libraries first on LD_LIBRARY_PATH
# LD_LIBRARY_PATH is set only for the wrapped programs and kit_run: the node's compiler, CMake, Python
# and PyTorch keep their own libraries (the kit's libssl or libz must never replace theirs).

KIT_MULTIARCH=x86_64-linux-gnu

# The .deb files to unpack: those MANIFEST.tsv names (written by scripts/gpu/prepare), else all.
kit_debs() {
  local kit=$1
  if [[ -f $kit/MANIFEST.tsv ]]; then
    awk -F'\t' -v d="$kit" 'NR > 1 && $4 != "" { print d "/" $4 }' "$kit/MANIFEST.tsv"
  else
    ls "$kit"/*.deb 2>/dev/null
  fi
}

# One .deb's files into PREFIX, with whichever tool the machine has: dpkg-deb, else ar + tar (+ the
# compressor), else Python's standard library (ar members and tarfile, which reads xz, gz and bz2).
kit_extract_one() {
  local deb=$1 prefix=$2 tool=$3
  case $tool in
    dpkg-deb) dpkg-deb -x "$deb" "$prefix" ;;
    ar)
      local member
      member=$(ar t "$deb" | grep -m1 '^data\.tar') || return 1
      case $member in
        *.xz) ar p "$deb" "$member" | xz -dc | tar -x -C "$prefix" ;;
        *.gz) ar p "$deb" "$member" | tar -xz -C "$prefix" ;;
        *.zst) ar p "$deb" "$member" | zstd -dc | tar -x -C "$prefix" ;;
        *) ar p "$deb" "$member" | tar -x -C "$prefix" ;;
      esac
      ;;
    python)
      "$KIT_PYTHON" - "$deb" "$prefix" <<'PYEOF'
import io, sys, tarfile
deb, prefix = sys.argv[1], sys.argv[2]
with open(deb, "rb") as f:
    if f.read(8) != b"!<arch>\n":
        sys.exit("%s: not an ar archive" % deb)
    while True:
        header = f.read(60)
        if len(header) < 60:
            sys.exit("%s: no data.tar member" % deb)
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58].decode().strip())
        body = f.read(size)
        if size % 2:
            f.read(1)
        if name.startswith("data.tar"):
            break
if name.endswith(".zst"):
    sys.exit("%s: zstd-compressed data, which Python's tarfile cannot read" % deb)
# Newer Pythons filter what they extract; the kit is our own download, with absolute symbolic links.
trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as t:
    t.extractall(prefix, **trusted)
PYEOF
      ;;
  esac
}

# The first tool that works here, in the order above ("" when none).
kit_extract_tool() {
  if command -v dpkg-deb >/dev/null 2>&1; then echo dpkg-deb; return; fi
  if command -v ar >/dev/null 2>&1 && command -v tar >/dev/null 2>&1 && command -v xz >/dev/null 2>&1; then echo ar; return; fi
  KIT_PYTHON=${KIT_PYTHON:-$(command -v python3 || true)}
  if [[ -n $KIT_PYTHON ]]; then echo python; return; fi
  echo ""
}

kit_unpack() {
  local kit=$1 prefix=$2 tool=${KIT_EXTRACT_TOOL:-$(kit_extract_tool)}
  KIT_PYTHON=${KIT_PYTHON:-$(command -v python3 || true)}
  case $prefix in
    "" | / | /usr | /usr/*) echo "kit: refusing to unpack into '$prefix'"; return 1 ;;
  esac
  [[ -n $tool ]] || { echo "kit: no dpkg-deb, no ar + tar + xz and no python3: cannot unpack .deb files"; return 1; }
  local debs=() d failed=0
  mapfile -t debs < <(kit_debs "$kit")
  ((${#debs[@]})) || { echo "kit: no .deb files in $kit (run scripts/gpu/prepare on a Debian 12 machine and carry gpu-kit)"; return 1; }
  # Only a folder this function made is ever emptied (its marker), or an empty one.
  if [[ -d $prefix && ! -e $prefix/.kit-prefix && ! -e $prefix/.kit-stamp && -n $(ls -A "$prefix") ]]; then
    echo "kit: refusing to empty $prefix: not a kit prefix (no .kit-prefix in it)"
    return 1
  fi
  rm -rf "$prefix" && mkdir -p "$prefix" && touch "$prefix/.kit-prefix" || return 1
  for d in "${debs[@]}"; do
    [[ -f $d ]] || { echo "kit: $d is missing (MANIFEST.tsv names it)"; failed=1; continue; }
    kit_extract_one "$d" "$prefix" "$tool" || { echo "kit: could not unpack $d with $tool"; failed=1; }
  done
  # Debian's few absolute symbolic links (libz.so -> /lib/...) would leave the prefix: point them into it.
  local link target
  while IFS= read -r link; do
    target=$(readlink "$link")
    ln -sfn "$prefix$target" "$link"
  done < <(find "$prefix" -type l -lname '/*')
  echo "kit: unpacked ${#debs[@]} packages into $prefix with $tool"
  return $failed
}

kit_env() {
  local p=$1 first=${2:-} lib=$1/usr/lib/$KIT_MULTIARCH
  KIT_LD_PATH=$lib:$p/lib/$KIT_MULTIARCH:$lib/openmpi/lib:$lib/hdf5/openmpi:$lib/pmix2/lib
  export KIT_LD_PATH KIT_PREFIX=$p KIT_BIN=$p/kit-bin
  # FIRST (colon-separated folders, e.g. PyTorch's wheels) goes before the kit on the wrapped
  # programs' library path; the linker's -rpath-link uses KIT_LD_PATH alone.
  kit_wrappers "$p" "${first:+$first:}$KIT_LD_PATH"
  # The wrappers, not the prefix's usr/bin: those programs need the kit's libraries to start.
  export PATH=$KIT_BIN:$PATH
  # Open MPI finds its components, help texts and wrapper data relative to OPAL_PREFIX. PMIx 4.2 does
  # not relocate by itself: its component folder is named (Debian's is under /usr/lib/.../pmix2).
  export OPAL_PREFIX=$p/usr PMIX_MCA_mca_base_component_path=$lib/pmix2/lib/pmix
  # hwloc's plugins (OpenCL, X11, ...) are not in the kit: none from the machine either.
  export HWLOC_PLUGINS_PATH=$lib/hwloc
  # No system-wide Open MPI settings of the node (or of this machine) leak in.
  export OMPI_MCA_mca_base_param_files=/dev/null
  # Components of transports left out of the kit (UCX, libfabric, verbs, PSM) fail to load: quietly,
  # and one node needs only shared memory and TCP anyway.
  export OMPI_MCA_mca_base_component_show_load_errors=0 OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader,tcp OMPI_MCA_osc=^ucx
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export PKG_CONFIG_LIBDIR=$lib/pkgconfig:$lib/openmpi/lib/pkgconfig:$p/usr/share/pkgconfig
  export PKG_CONFIG_SYSROOT_DIR=$p PKG_CONFIG=$KIT_BIN/pkgconf
}

# PREFIX/kit-bin: mpirun, mpiexec, mpicc, ompi_info, orted, pkgconf and pkg-config, each starting the
# prefix's program with PATH (FIRST, then the kit's libraries) first on LD_LIBRARY_PATH (what mpirun
# starts inherits it).
# The compiler, CMake and Python never get them: the node's compiler may need a newer libz, libzstd or
# libgmp than Debian 12's, and its Python a newer libssl.
kit_wrappers() {
  local p=$1 path=$2 tool real
  mkdir -p "$p/kit-bin"
  for tool in mpirun mpiexec mpicc ompi_info orted pkgconf pkg-config; do
    case $tool in
      mpirun | mpiexec | mpicc) real=$p/usr/bin/$tool.openmpi ;;
      pkg-config) real=$p/usr/bin/pkgconf ;;
      *) real=$p/usr/bin/$tool ;;
    esac
    printf '#!/usr/bin/env bash\nexport LD_LIBRARY_PATH=%q${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}\nexec %q "$@"\n' "$path" "$real" >"$p/kit-bin/$tool"
    chmod +x "$p/kit-bin/$tool"
  done
}

kit_run() {
  LD_LIBRARY_PATH=$KIT_LD_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$@"
}
