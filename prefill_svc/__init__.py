"""prefill_svc: run it with ``python -m prefill_svc``. Importing the package sets the services' OpenMP
spin (kvwire_serving.cores.service_openmp_env) before anything loads torch."""
from kvwire_serving.cores import service_openmp_env

service_openmp_env()
